"""``splitserve bench serve``'s command line: the flags (``ServeCommand``: the run's and the workload's fields, and
what to do with the runs), then one run or a sweep (``driver.py``), its report (``report.py``), JSON and pictures.

    splitserve bench serve --base-url http://127.0.0.1:8000 --request-rate 2 --num-prompts 200 \\
        --input-len 256 --output-len 64 --goodput ttft:1000 tpot:150 --json run.json --plot run.png
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

from splitserve.bench.serve.driver import run_serve_benchmark, run_sweep
from splitserve.bench.serve.plots import plot_run, plot_sweep
from splitserve.bench.serve.report import report, report_sweep
from splitserve.bench.serve.run import ServeBenchConfig
from splitserve.measure.figures import FiguresOutput, save_results
from splitserve.measure.serve_metrics import SLO, SLO_ATTAINMENT
from splitserve.measure.workload import WorkloadConfig
from splitserve.runtime.config import described, parse_config, passed_to, passed_values

EXAMPLES = """examples:
  splitserve bench serve --request-rate 2 --num-prompts 100 --input-len 256 --output-len 64 \\
      --goodput ttft:1000 tpot:150 --json run.json --plot run.png
  splitserve bench serve --backend grpc --grpc-address 127.0.0.1:50051 --max-concurrency 8
  splitserve bench serve --workload measure/traces/AzureLLMInferenceTrace_conv.csv.gz \\
      --time-scale 20 --max-prompt-tokens 1024 --max-output-tokens 64 --num-prompts 200
  splitserve bench serve --workload azure-code --sweep 0.25,0.5,1,2 --sweep-refine 2 \\
      --goodput ttft:2000 tpot:200 --max-prompt-tokens 2048 --plot sweep.png
pin the generator away from the servers on a small machine: taskset -c 1 python -m splitserve ..."""


@dataclass
class ServeCommand(FiguresOutput):
    """Drive a running router (HTTP or gRPC) with a seeded workload; report throughput, goodput and TTFT / TPOT /
    ITL / E2E percentiles measured at the client, beside the router's own histograms.

    The command line of ``bench serve``: the run's fields and the workload's come with their defaults and help
    from ``ServeBenchConfig`` and ``WorkloadConfig`` (``splitserve.runtime.config.passed_to``); the rest say what to
    do with the runs."""

    backend: str = passed_to(ServeBenchConfig, name="backend")
    base_url: str = passed_to(ServeBenchConfig, name="base_url")
    grpc_address: str = passed_to(ServeBenchConfig, name="grpc_address")
    model: str | None = passed_to(ServeBenchConfig, name="model")
    tokenizer: str | None = passed_to(ServeBenchConfig, name="tokenizer")
    router_metrics: bool = passed_to(ServeBenchConfig, name="router_metrics")
    workload: str = passed_to(WorkloadConfig, name="workload")
    num_prompts: int = passed_to(WorkloadConfig, name="num_prompts")
    request_rate: float = passed_to(WorkloadConfig, name="request_rate")
    burstiness: float = passed_to(WorkloadConfig, name="burstiness")
    max_concurrency: int | None = passed_to(ServeBenchConfig, name="max_concurrency")
    input_len: int = passed_to(WorkloadConfig, name="input_len")
    output_len: int = passed_to(WorkloadConfig, name="output_len")
    range_ratio: float = passed_to(WorkloadConfig, name="range_ratio")
    time_scale: float = passed_to(WorkloadConfig, name="time_scale")
    max_prompt_tokens: int | None = passed_to(WorkloadConfig, name="max_prompt_tokens")
    max_output_tokens: int | None = passed_to(WorkloadConfig, name="max_output_tokens")
    shared_prefix: int = passed_to(ServeBenchConfig, name="shared_prefix")
    prompt_format: str = passed_to(ServeBenchConfig, name="prompt_format")
    temperature: float = passed_to(ServeBenchConfig, name="temperature")
    seed: int = passed_to(WorkloadConfig, name="seed")
    goodput: list[str] = field(default_factory=list, metadata=described(
        "Targets a request must all meet to count as good, NAME:MS: ttft:MS tpot:MS e2el:MS."))
    sweep: list[float] = field(default_factory=list, metadata=described(
        "Request rates to run in turn (needs --goodput); empty: one run at --request-rate."))
    sweep_refine: int = field(default=0, metadata=described(
        "After the sweep, K bisections between the last rate meeting the targets and the next."))
    slo_attainment: float = field(default=SLO_ATTAINMENT, metadata=described(
        "Share of requests that must meet the targets for a rate to pass a sweep."))
    request_timeout_s: float = passed_to(ServeBenchConfig, name="request_timeout_s")
    time_limit_s: float | None = passed_to(ServeBenchConfig, name="time_limit_s")
    warmup: int = passed_to(ServeBenchConfig, name="warmup")
    progress: bool = passed_to(ServeBenchConfig, name="progress")
    save_detailed: bool = field(default=False, metadata=described("Include every request's timings in the JSON."))

    def __post_init__(self) -> None:
        if any(not rate > 0 for rate in self.sweep):
            raise ValueError(f"sweep rates must be > 0, got {self.sweep}")
        self.bench_config()  # every field's own checks, naming it, before anything runs

    def bench_config(self) -> ServeBenchConfig:
        return ServeBenchConfig(workload=WorkloadConfig(**passed_values(self, WorkloadConfig)),
                                slo=SLO.parse(self.goodput), **passed_values(self, ServeBenchConfig))


def main(argv: list[str] | None = None) -> dict:
    command = parse_config(ServeCommand, argv, prog="splitserve bench serve", epilog=EXAMPLES)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    config = command.bench_config()
    try:
        if command.sweep:
            sweep = run_sweep(config, command.sweep, command.slo_attainment, command.sweep_refine)
        else:
            run = run_serve_benchmark(config)
    except (RuntimeError, ValueError) as error:  # the router is not there, or refuses even the warm-up
        sys.exit(f"splitserve bench serve: {error}")
    if command.sweep:
        report_sweep(sweep)
        results = {**sweep, "runs": [run.to_json(command.save_detailed) for run in sweep["runs"]]}
        draw = lambda _, path: plot_sweep(sweep, path)  # noqa: E731
    else:
        report(run)
        results = run.to_json(command.save_detailed)
        draw = lambda _, path: plot_run(run, path)  # noqa: E731
    save_results(results, command.json, command.plot, draw)
    return results
