"""The ``splitserve`` command line: one subcommand per job.

  splitserve up [--prefill 1 --decode 1 --mixed 0 ...]   the whole system on this machine (router + pods)
  splitserve generate "text" [--router host:port]       stream an answer from a running router
  splitserve router | prefill | decode [flags]          run one process (flags: --help)
  splitserve demo [--model M] [PROMPT ...]              offline generation with the engine
  splitserve bench engine | codecs | transfer [...]     benchmarks against a baseline measured in the same run
  splitserve bench serve [--request-rate R ...]         load a running router: goodput, TTFT/TPOT/ITL percentiles
  splitserve bench compare [--topologies ...]           disaggregated vs colocated vs conditional on the same cores
  splitserve bench phases [--prompt-lens ...]           prefill and decode on this machine: throughput, roofline
  splitserve bench soak [--duration 180 ...]            a cluster under load with injected faults: failures, leaks
  splitserve bench spec [--batches 1,4,16 ...]          speculative decoding on vs off: tokens/s, TPOT, acceptance
  splitserve simulate [--pools prefill:1,decode:1 ...]  the router and pods on a virtual clock, from a profile
  splitserve bench llamacpp [--threads 1,2 ...]         beside llama.cpp on the same GGUF: ms/token, tokens/s, lookup
  splitserve bench moe [--experts 8 --top-k 2 ...]      a mixture of experts beside a dense model of its active size
  splitserve bench lm_eval [--lm-eval-python PATH]      lm-eval against a cluster, each answer checked offline
  splitserve bench tp [--tensor-parallel-sizes 1,2 ...]  TP 1 vs TP N on this machine, all-reduce cost, 8-rank
                                                        projection
  splitserve build-kernels [--baselines]                build the engine's native CPU kernels now (set-up does)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from splitserve.engine.config import DEFAULT_MODEL
from splitserve.runtime.logs import configure_logging


def _demo(argv: list[str]) -> None:
    from splitserve.engine import LLM, SamplingParams

    parser = argparse.ArgumentParser(prog="splitserve demo", description="Offline generation with the engine.")
    parser.add_argument("prompts", nargs="*", default=[
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in one sentence what a KV cache is.",
    ])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)
    print(f"loading {args.model} ...", file=sys.stderr)
    llm = LLM(model=args.model)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompts, outputs):
        print(f"\n> {prompt}\n{out.text.strip()}\n  [{len(out.token_ids)} tokens, finish={out.finish_reason}]")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tok/s)")


def _build_kernels(argv: list[str]) -> None:
    """Build (or find) the native CPU kernels' library this machine's processes will load, and load it once, which
    checks its ABI. Exits 1 when a CPU that can run the kernels cannot have them; elsewhere says so and exits 0."""
    from splitserve.engine.kernels import cpu_kernels
    from splitserve.engine.kernels.build import build_baselines, supported_cpu

    parser = argparse.ArgumentParser(prog="splitserve build-kernels", description=_build_kernels.__doc__)
    parser.add_argument("--baselines", action="store_true", help=(
        "first build every declared baseline (x86-64-v3, x86-64-v4, x86-64-v4 with VNNI), whatever this CPU runs: "
        "for an image whose pods run on other CPUs (SPLITSERVE_KERNEL_TARGET=baseline; engine/kernels/build.py)"))
    if parser.parse_args(argv).baselines:
        for path in build_baselines():
            print(f"baseline kernels: {path}")
    choice = cpu_kernels.load()
    print(f"engine compute path on this machine: {choice}")
    if choice.kernels is None and supported_cpu() and os.environ.get("SPLITSERVE_CPU_KERNELS", "1") != "0":
        sys.exit(1)


# ``splitserve bench NAME`` -> the benchmark's module (its ``main``), imported only when that subcommand runs.
BENCHMARKS = {
    "engine": "splitserve.bench.engine", "codecs": "splitserve.bench.codecs", "transfer": "splitserve.bench.transfer",
    "serve": "splitserve.bench.serve.command", "compare": "splitserve.bench.compare.command",
    "phases": "splitserve.bench.phases.command", "soak": "splitserve.bench.soak", "spec": "splitserve.bench.spec",
    "structured": "splitserve.bench.structured", "llamacpp": "splitserve.bench.llamacpp",
    "lm_eval": "splitserve.bench.lm_eval", "tp": "splitserve.bench.tp", "moe": "splitserve.bench.moe",
}


def _bench(argv: list[str]) -> None:
    """``splitserve bench NAME``: the benchmark NAME's module, imported only now (nothing else imports the
    benchmarks: pyproject's import contracts)."""
    if not argv or argv[0] not in BENCHMARKS:
        sys.exit(f"usage: splitserve bench {{{'|'.join(BENCHMARKS)}}} [options]")
    _delegate(BENCHMARKS[argv[0]])(argv[1:])


def _delegate(module: str):
    def run(argv: list[str]) -> None:
        import importlib

        importlib.import_module(module).main(argv)

    return run


COMMANDS = {
    "up": _delegate("splitserve.launcher"),
    "generate": _delegate("splitserve.client"),
    "router": _delegate("splitserve.router.server"),
    "prefill": _delegate("splitserve.prefill_service.server"),
    "decode": _delegate("splitserve.decode_service.server"),
    "demo": _demo,
    "bench": _bench,
    "simulate": _delegate("splitserve.simulator.run"),  # the top of the house: imported only when it runs
    "build-kernels": _build_kernels,
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.exit(__doc__)
    configure_logging()
    COMMANDS[argv[0]](argv[1:])
