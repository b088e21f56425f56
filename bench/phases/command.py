"""``splitserve bench phases``: the measurements behind the Splitwise design, on this machine, with the engine
in-process: prefill is compute-bound and decode memory-bound, so they want different hardware (and pods).

  prefill  one prompt of each length (``--prompt-lens``, 64 to 4096 for the full grid) run through the engine's
           scheduler as a pod runs it (chunks of ``long_prefill_token_threshold`` tokens): TTFT (best of
           ``--repeat``), prompt tokens/s, and per step the FLOPs computed and the bytes moved;
  decode   ``--batches`` x ``--contexts`` (batch 1 to 64, context 128 to 4096 for the full grid): sequences whose
           prompt KV is admitted as a decode pod admits a transferred one (``reserve_for_transfer`` +
           ``admit_prefilled``; every page of that KV written with real values first, as a transfer writes it: a
           never-written page reads the kernel's shared zero page from cache), then ``--steps`` decode steps
           timed (median): ms per step, tokens/s, FLOPs and bytes per step, and the step's bandwidth floor;
  machine  the float32 matmul peak and the read bandwidth (``bench engine``'s measurements), before and after the
           run, the higher of each: the roofs of the roofline.

``--prefill-formats`` measures instead prefill in each prefill compute format, float32 and bfloat16, side by side on
one pinned thread and on two, against the bf16 GEMM peak of the same shapes (bench/phases/prefill_formats.py);
``--kv-pools`` decode in each KV pool format (``--pool-dtypes``) side by side on one pinned thread, against each
one's byte floor, and each one's capacity (bench/phases/kv_pools.py);
``--kv-schemes`` KV formats not built, simulated on the model, their answers against float16's
(bench/phases/kv_schemes.py); ``--prefill-quality`` each format's answers against float32's on the real model
(bench/phases/prefill_quality.py).

FLOPs and bytes come from the model's config (``step_cost.py``): matmul FLOPs of projections, MLP, attention and
the sampled lm_head rows; bytes at least every weight once per step plus the K/V read and written. The roofline
plot puts every prefill and decode point at its operational intensity (FLOP per byte) and achieved GFLOP/s under
the machine's two roofs: prefill sits at the compute roof, decode far left under the bandwidth roof.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from splitserve.bench.engine import matmul_peak, read_bandwidth
from splitserve.bench.phases import (
    attention_probe,
    kv_pools,
    kv_schemes,
    llamacpp_pools,
    prefill_formats,
    prefill_quality,
)
from splitserve.bench.phases.sequences import admit_transferred, random_prompt
from splitserve.bench.phases.step_cost import (
    decode_bytes,
    decode_flops,
    kv_bytes_per_token,
    prefill_bytes,
    prefill_flops,
)
from splitserve.engine.config import (
    CACHE_DTYPES,
    DEFAULT_MODEL,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.measure.figures import FiguresOutput, headless_pyplot, save_figure, save_results
from splitserve.measure.phase_profile import profile_from_phases
from splitserve.runtime.config import described, parse_config

DEFAULT_PROMPT_LENS = (64, 256, 1024, 2048)
DEFAULT_BATCHES = (1, 4, 16, 64)
DEFAULT_CONTEXTS = (128, 1024)
FULL_PROMPT_LENS = (64, 128, 256, 512, 1024, 2048, 4096)
FULL_BATCHES = (1, 2, 4, 8, 16, 32, 64)
FULL_CONTEXTS = (128, 256, 512, 1024, 2048, 4096)
PROBE_BATCH, PROBE_CONTEXT = 16, 4096  # --attention-probe's point: issue 46's float16 target
WARMUP_STEPS = 2  # decode steps run before the timed ones


@dataclass
class PhasesConfig(FiguresOutput):
    """Prefill and decode of the engine on this machine: throughput, TTFT and step time against prompt length, batch
    and context; FLOPs and bytes per step against the measured peak and bandwidth (a roofline)."""

    model: str = field(default=DEFAULT_MODEL, metadata=described("Model to load (tiny-random for a quick run)."))
    prompt_lens: list[int] = field(default_factory=lambda: list(DEFAULT_PROMPT_LENS), metadata=described(
        "Prefill prompt lengths."))
    batches: list[int] = field(default_factory=lambda: list(DEFAULT_BATCHES), metadata=described(
        "Decode batch sizes."))
    contexts: list[int] = field(default_factory=lambda: list(DEFAULT_CONTEXTS), metadata=described(
        "Decode context lengths."))
    full: bool = field(default=False, metadata=described(
        "The full grid (prompts 64..4096, batch 1..64 x context 128..4096), in place of the three above."))
    steps: int = field(default=16, metadata=described("Decode steps timed per point (median kept)."))
    repeat: int = field(default=2, metadata=described("Prefills per prompt length (best kept)."))
    cache_dtype: str = field(default=CacheConfig.cache_dtype, metadata=described("The KV cache's dtype."))
    prefill_compute_dtype: str = field(default=EngineConfig.prefill_compute_dtype, metadata=described(
        "What prefill's products compute in (float32, bfloat16, auto), as a pod's flag: the steps measured, and so "
        "the --profile-out fit, are that format's."))
    int8_activations: bool = field(default=EngineConfig.int8_activations, metadata=described(
        "As a pod's flag: the products over the quantized weights quantize their inputs to int8 and sum integer dot "
        "products (llama.cpp's scheme; not the float32 path's bits, docs/quantization.md), in the main run and in "
        "--kv-pools' engines."))
    seed: int = field(default=0, metadata=described("Seeds the prompts and torch."))
    machine_rounds: int = field(default=3, metadata=described(
        "Rounds of the peak and bandwidth measurements, before and after (best kept)."))
    threads: int = field(default=0, metadata=described("Torch compute threads (0: torch's default)."))
    tensor_parallel_size: int = field(default=EngineConfig.tensor_parallel_size, metadata=described(
        "Ranks the engine splits the model over, as a pod's flag (they share out this process's CPUs): the "
        "--profile-out profile records it, and the simulator counts its pods at this many ranks."))
    profile_out: str = field(default="", metadata=described(
        "Also fit the step times to DistServe's forms and write the simulator's profile file here "
        "(bench/phase_profile.py, splitserve simulate)."))
    profile_note: str = field(default="", metadata=described(
        "The profile's note: the machine and its conditions (loaded? pinned?)."))
    prefill_formats: bool = field(default=False, metadata=described(
        "Instead: prefill per prompt length (default 128,512,2048) in float32 and bfloat16 side by side, on one pinned "
        "thread and on two, --repeat rounds, against the bf16 GEMM peak of the same shapes."))
    kv_pools: bool = field(default=False, metadata=described(
        "Instead: decode in each KV pool format (--pool-dtypes) side by side on one pinned thread, every page of KV "
        "real, --repeat rounds, at --batches x --contexts (default 1,16,64 x 512,4096), against each "
        "one's byte floor; and the sequences of 4096 tokens a 1 GiB pool holds in each."))
    llamacpp_kv_types: list[str] = field(default_factory=lambda: list(llamacpp_pools.KV_TYPES), metadata=described(
        "--kv-pools: llama.cpp's KV cache types (f16, q8_0, q4_0) measured beside the pool formats, on the same GGUF "
        "file and pinned CPU, where llama-cpp-python is installed (the llamacpp extra); empty: none."))
    pool_dtypes: list[str] = field(default_factory=lambda: list(kv_pools.POOL_DTYPES), metadata=described(
        "The KV pool formats --kv-pools and --kv-pool-quality compare, the first the baseline of --kv-pools."))
    attention_probe: bool = field(default=False, metadata=described(
        "Instead: the decode attention alone per pool format (--pool-dtypes) at the largest of --batches x --contexts "
        "(default 16 x 4096), its blocks scattered, in order and cache-resident (the arithmetic alone), in thread CPU "
        "time on one pinned thread (bench/phases/attention_probe.py)."))
    kv_pool_quality: bool = field(default=False, metadata=described(
        "Instead: each KV pool format's answers against the float16 pool's on the model, teacher-forced top-1 "
        "agreement and perplexity over 1024-token windows of GPL-3, prefilled in --prefill-compute-dtype "
        "(bench/phases/kv_pools.py)."))
    kv_schemes: list[str] = field(default_factory=list, metadata=described(
        "Instead: these KV formats *simulated* on the model before any is built (bench/phases/kv_schemes.py: "
        + ", ".join(kv_schemes.SCHEMES) + "), top-1 agreement and perplexity against float16 as "
        "--kv-pool-quality measures them, and each one's bytes per value and capacity."))
    prefill_quality: bool = field(default=False, metadata=described(
        "Instead: each prefill format's answers against float32's on the real model (teacher-forced top-1 agreement, "
        "perplexity), bfloat16 and simulated int8 W8A8 (bench/phases/prefill_quality.py)."))

    def __post_init__(self) -> None:
        if self.full:
            self.prompt_lens, self.batches, self.contexts = (list(FULL_PROMPT_LENS), list(FULL_BATCHES),
                                                             list(FULL_CONTEXTS))
        for name in ("prompt_lens", "batches", "contexts"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive integers, got {getattr(self, name)}")
        if self.steps < 1 or self.repeat < 1 or self.machine_rounds < 1:
            raise ValueError("steps, repeat and machine_rounds must be >= 1")
        for dtype in (self.cache_dtype, *self.pool_dtypes):
            if dtype not in CACHE_DTYPES:
                raise ValueError(f"KV pool dtypes must be among {', '.join(CACHE_DTYPES)}, got {dtype!r}")
        if unknown := set(self.llamacpp_kv_types) - set(llamacpp_pools.KV_TYPES):
            raise ValueError(f"llamacpp_kv_types: {sorted(unknown)}; choose from {', '.join(llamacpp_pools.KV_TYPES)}")


def run(config: PhasesConfig, log=print) -> dict:
    log("measuring the machine: fp32 matmul peak and read bandwidth ...")
    peak_before, read_before = matmul_peak(config.machine_rounds), read_bandwidth(config.machine_rounds)
    cpus = len(os.sched_getaffinity(0))  # before a TP engine pins rank 0 to its share of them
    engine = _engine(config)
    cfg = engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    elem_bytes = engine.runner.kv_cache.element_size
    log(f"{cfg.name}: {cfg.num_layers} layers, {weight_bytes / 1e6:.0f} MB of weights, KV cache {config.cache_dtype} "
        f"({kv_bytes_per_token(cfg, elem_bytes)} bytes per token), prefill computes in {engine.prefill_compute}")
    rng = random.Random(config.seed)
    prompt_lens = [n for n in config.prompt_lens if n < engine.max_model_len]
    skipped = sorted(set(config.prompt_lens) - set(prompt_lens))
    if skipped:
        log(f"skipping prompt lengths {skipped}: the model's context is {engine.max_model_len} tokens")
    _prefill_once(engine, random_prompt(rng, cfg, 16))  # first-use costs
    prefill, prefill_steps = {}, {}
    for i, n in enumerate(prompt_lens):
        log(f"[{i + 1}/{len(prompt_lens)}] prefill {n} tokens, best of {config.repeat} ...")
        best = min((_prefill_once(engine, random_prompt(rng, cfg, n)) for _ in range(config.repeat)),
                   key=lambda steps: sum(seconds for _, _, seconds in steps))
        prefill[n] = _prefill_figures(cfg, weight_bytes, elem_bytes, n, best)
        prefill_steps[n] = best
    points = [(b, c) for c in config.contexts for b in config.batches if c + config.steps + 8 < engine.max_model_len]
    decode = {}
    for i, (batch, context) in enumerate(points):
        log(f"[{i + 1}/{len(points)}] decode batch {batch}, context {context}: {config.steps} steps ...")
        seconds = _decode_step_seconds(engine, rng, batch, context, config.steps)
        decode[f"{batch}x{context}"] = _decode_figures(cfg, weight_bytes, elem_bytes, batch, context, seconds)
    log("measuring the machine again ...")
    peak = max(peak_before, matmul_peak(config.machine_rounds))
    read = max(read_before, read_bandwidth(config.machine_rounds))
    for figures in list(prefill.values()) + list(decode.values()):
        figures["share_of_peak"] = figures["gflops"] / peak
        figures["floor_ms"] = figures["bytes_per_step"] / read / 1e6
    return {"model": cfg.name, "config": dataclasses.asdict(config),
            "machine": {"matmul_gflops": peak, "read_gbps": read, "matmul_gflops_before": peak_before,
                        "read_gbps_before": read_before, "ridge_flop_per_byte": peak / read},
            "prefill_compute": engine.prefill_compute, "weight_bytes": weight_bytes,
            "kv_bytes_per_token": kv_bytes_per_token(cfg, elem_bytes),
            "prefill": prefill, "decode": decode, "threads": torch.get_num_threads(),
            "tensor_parallel_size": config.tensor_parallel_size, "cpus": cpus,
            "prefill_steps": {n: [list(step) for step in steps] for n, steps in prefill_steps.items()}}


def _engine(config: PhasesConfig) -> LLMEngine:
    """An engine with the pods' scheduler settings, a KV pool sized for the largest decode point and prompt, and room
    for ``max(batches)`` sequences at once."""
    block = CacheConfig().block_size
    blocks_per_seq = lambda tokens: math.ceil(tokens / block) + 1  # noqa: E731
    decode_blocks = max(b * blocks_per_seq(c + config.steps + WARMUP_STEPS + 2)
                        for b in config.batches for c in config.contexts)
    num_blocks = max(decode_blocks, blocks_per_seq(max(config.prompt_lens) + 2)) + 16
    cache = CacheConfig(num_blocks=num_blocks, cache_dtype=config.cache_dtype)
    scheduler = SchedulerConfig(max_num_seqs=max(SchedulerConfig().max_num_seqs, max(config.batches)))
    return LLMEngine(EngineConfig(model=config.model, seed=config.seed, cache=cache, scheduler=scheduler,
                                  prefill_compute_dtype=config.prefill_compute_dtype,
                                  int8_activations=config.int8_activations,
                                  tensor_parallel_size=config.tensor_parallel_size))


def _prefill_once(engine: LLMEngine, prompt: list[int]) -> list[tuple[int, int, float]]:
    """Runs one prompt to its first token, step by step as a pod does: (context before, tokens, seconds) per step."""
    engine.add_request(f"prefill-{time.monotonic_ns()}", prompt, SamplingParams(temperature=0, max_tokens=1))
    steps = []
    while engine.has_unfinished_requests():
        batch, seconds = _timed_step(engine)
        item = batch.scheduled[0]
        steps.append((item.start, item.num_new_tokens, seconds))
    return steps


def _timed_step(engine: LLMEngine) -> tuple[SchedulerOutput, float]:
    """One engine step, schedule -> execute -> update as ``LLMEngine.step`` does, timed: the batch it scheduled and
    its seconds."""
    start = time.perf_counter()
    batch = engine.scheduler.schedule()
    sampled = engine.runner.execute(batch)
    engine.scheduler.update_from_output(batch, sampled)
    return batch, time.perf_counter() - start


def _prefill_figures(cfg: ModelConfig, weight_bytes: int, elem_bytes: int, n: int,
                     steps: list[tuple[int, int, float]]) -> dict:
    seconds = sum(s for _, _, s in steps)
    flops = prefill_flops(cfg, n)
    moved = sum(prefill_bytes(cfg, weight_bytes, tokens, before, elem_bytes) for before, tokens, _ in steps)
    return {"ttft_ms": seconds * 1e3, "tok_s": n / seconds, "steps": len(steps),
            "step_tokens": [tokens for _, tokens, _ in steps], "flops_per_step": flops / len(steps),
            "bytes_per_step": moved / len(steps), "flop_per_byte": flops / moved, "gflops": flops / seconds / 1e9}


def _decode_step_seconds(engine: LLMEngine, rng: random.Random, batch: int, context: int, steps: int) -> float:
    """Median seconds of a decode step of ``batch`` sequences at ``context`` tokens, their prompt KV admitted as a
    decode pod admits a transferred one, every page of it real (``sequences.admit_transferred``)."""
    admit_transferred(engine, rng, batch, context, max_tokens=steps + WARMUP_STEPS + 1)
    times = []
    while engine.has_unfinished_requests():
        scheduled, seconds = _timed_step(engine)
        if len(scheduled.scheduled) == batch and all(s.num_new_tokens == 1 for s in scheduled.scheduled):
            times.append(seconds)
    return statistics.median(times[WARMUP_STEPS:])


def _decode_figures(cfg: ModelConfig, weight_bytes: int, elem_bytes: int, batch: int, context: int,
                    seconds: float) -> dict:
    flops = decode_flops(cfg, batch, context)
    moved = decode_bytes(cfg, weight_bytes, batch, context, elem_bytes)
    return {"batch": batch, "context": context, "ms_per_step": seconds * 1e3, "tok_s": batch / seconds,
            "flops_per_step": flops, "bytes_per_step": moved, "flop_per_byte": flops / moved,
            "gflops": flops / seconds / 1e9}


# ----------------------------------------------------------------------------------------------- report


def report(results: dict, log=print) -> None:
    m = results["machine"]
    log(f"\n== machine == fp32 matmul peak {m['matmul_gflops']:.1f} GFLOP/s, read bandwidth {m['read_gbps']:.1f} GB/s "
        f"(the higher of before / after); ridge point {m['ridge_flop_per_byte']:.1f} FLOP/byte")
    log(f"\n== prefill ({results['model']}) ==")
    log(f"{'tokens':>7}{'TTFT ms':>10}{'tok/s':>8}{'steps':>6}{'GFLOP/step':>11}{'MB/step':>9}{'FLOP/B':>8}"
        f"{'GFLOP/s':>9}{'of peak':>8}")
    for n, r in results["prefill"].items():
        log(f"{n:>7}{r['ttft_ms']:>10.1f}{r['tok_s']:>8.0f}{r['steps']:>6}{r['flops_per_step'] / 1e9:>11.2f}"
            f"{r['bytes_per_step'] / 1e6:>9.1f}{r['flop_per_byte']:>8.1f}{r['gflops']:>9.1f}{r['share_of_peak']:>8.0%}")
    log(f"\n== decode ({results['model']}, KV cache {results['config']['cache_dtype']}) ==")
    log(f"{'batch':>6}{'context':>8}{'ms/step':>9}{'tok/s':>8}{'GFLOP/step':>11}{'MB/step':>9}{'FLOP/B':>8}"
        f"{'GFLOP/s':>9}{'floor ms':>9}{'/ floor':>8}")
    for r in results["decode"].values():
        log(f"{r['batch']:>6}{r['context']:>8}{r['ms_per_step']:>9.2f}{r['tok_s']:>8.0f}"
            f"{r['flops_per_step'] / 1e9:>11.2f}"
            f"{r['bytes_per_step'] / 1e6:>9.1f}{r['flop_per_byte']:>8.2f}{r['gflops']:>9.1f}{r['floor_ms']:>9.2f}"
            f"{r['ms_per_step'] / r['floor_ms']:>7.2f}x")
    log("(floor: the step's bytes at the measured read bandwidth; FLOP/B: operational intensity; bytes are at least "
        "the weights once per step plus the K/V read and written)")


def plot(results: dict, path: str) -> None:
    """Prefill TTFT and tokens/s against prompt length, decode ms/step and tokens/s against batch per context,
    and the roofline with both phases on it."""
    plt = headless_pyplot()
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
    (ttft_ax, step_ax), (tok_ax, roof_ax) = axes
    lens = [int(n) for n in results["prefill"]]
    pre = list(results["prefill"].values())
    ttft_ax.plot(lens, [r["ttft_ms"] for r in pre], "o-", color="tab:blue", label="TTFT")
    ttft_ax.set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="TTFT (ms)", title="prefill")
    rate_ax = ttft_ax.twinx()
    rate_ax.plot(lens, [r["tok_s"] for r in pre], "s--", color="tab:orange", label="prompt tokens/s")
    rate_ax.set(ylabel="prompt tokens/s", ylim=(0, max(r["tok_s"] for r in pre) * 1.2) if pre else None)
    ttft_ax.set_xticks(lens, [str(n) for n in lens])
    ttft_ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ttft_ax.yaxis.set_major_formatter(ScalarFormatter())
    ttft_ax.yaxis.set_minor_formatter(NullFormatter())
    ttft_ax.legend(loc="upper left")
    rate_ax.legend(loc="lower right")
    by_context: dict[int, list[dict]] = {}
    for r in results["decode"].values():
        by_context.setdefault(r["context"], []).append(r)
    for context, rows in sorted(by_context.items()):
        batches = [r["batch"] for r in rows]
        step_ax.plot(batches, [r["ms_per_step"] for r in rows], "o-", label=f"context {context}")
        tok_ax.plot(batches, [r["tok_s"] for r in rows], "o-", label=f"context {context}")
    for ax, label in ((step_ax, "ms per decode step"), (tok_ax, "decode tokens/s")):
        ax.set(xscale="log", xlabel="batch (sequences)", ylabel=label, title="decode")
        batches = sorted({r["batch"] for r in results["decode"].values()})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.grid(alpha=0.3)
        ax.legend()
    _roofline(roof_ax, results)
    fig.suptitle(f"{results['model']}: prefill and decode on this machine (fp32 compute, "
                 f"{results['config']['cache_dtype']} KV cache)")
    save_figure(fig, path)


def _roofline(ax, results: dict) -> None:
    m = results["machine"]
    points = [r["flop_per_byte"] for r in list(results["prefill"].values()) + list(results["decode"].values())]
    lo, hi = min(points + [m["ridge_flop_per_byte"]]) / 3, max(points + [m["ridge_flop_per_byte"]]) * 3
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(xs, [min(m["matmul_gflops"], m["read_gbps"] * x) for x in xs], "k-", linewidth=1.5,
            label=f"roof: {m['matmul_gflops']:.0f} GFLOP/s peak, {m['read_gbps']:.1f} GB/s")
    pre = results["prefill"]
    ax.plot([r["flop_per_byte"] for r in pre.values()], [r["gflops"] for r in pre.values()], "o", color="tab:blue",
            label="prefill (label: prompt tokens)")
    for n, r in pre.items():
        ax.annotate(str(n), (r["flop_per_byte"], r["gflops"]), textcoords="offset points", xytext=(4, -10), fontsize=7)
    contexts = sorted({r["context"] for r in results["decode"].values()})
    for marker, context in zip("sD^v<>p", contexts):
        rows = [r for r in results["decode"].values() if r["context"] == context]
        ax.plot([r["flop_per_byte"] for r in rows], [r["gflops"] for r in rows], marker, linestyle="none",
                label=f"decode, context {context} (label: batch)")
        for r in rows:
            ax.annotate(str(r["batch"]), (r["flop_per_byte"], r["gflops"]), textcoords="offset points",
                        xytext=(4, 3), fontsize=7)
    ax.set(xscale="log", yscale="log", xlabel="operational intensity (FLOP / byte)", ylabel="achieved GFLOP/s",
           title="roofline")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")


# ---------------------------------------------------------------------------------------------- command line


EXAMPLES = """The defaults finish in a few minutes on 2 cores. The full grid (about 6 GB of float16 KV cache for the
largest decode point) is --full, or explicitly:
  splitserve bench phases --prompt-lens 64,128,256,512,1024,2048,4096 --batches 1,2,4,8,16,32,64 \\
      --contexts 128,256,512,1024,2048,4096 --json phases.json --plot phases.png"""


def main(argv: list[str] | None = None) -> dict:
    config = parse_config(PhasesConfig, argv, prog="splitserve bench phases", epilog=EXAMPLES)
    torch.manual_seed(config.seed)
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.prefill_quality:
        results = prefill_quality.run(config.model)
        prefill_quality.report(results)
        save_results(results, config.json)
        return results
    if config.kv_pool_quality:
        results = kv_pools.quality(config.model, config.pool_dtypes, config.prefill_compute_dtype)
        kv_pools.report_quality(results)
        save_results(results, config.json)
        return results
    if config.kv_schemes:
        results = kv_schemes.run(config.model, config.kv_schemes)
        kv_schemes.report(results)
        save_results(results, config.json)
        return results
    default = lambda name, value: getattr(config, name) == list(value)  # noqa: E731
    if config.attention_probe:
        results = attention_probe.run(config.model, config.pool_dtypes,
                                      PROBE_BATCH if default("batches", DEFAULT_BATCHES) else max(config.batches),
                                      PROBE_CONTEXT if default("contexts", DEFAULT_CONTEXTS) else max(config.contexts),
                                      config.repeat, config.seed)
        attention_probe.report(results)
        save_results(results, config.json)
        return results
    if config.kv_pools:
        results = kv_pools.run(
            config.model, config.pool_dtypes,
            list(kv_pools.BATCHES) if default("batches", DEFAULT_BATCHES) else config.batches,
            list(kv_pools.CONTEXTS) if default("contexts", DEFAULT_CONTEXTS) else config.contexts,
            config.steps, config.repeat, config.seed, config.llamacpp_kv_types, config.int8_activations)
        kv_pools.report(results)
        save_results(results, config.json, config.plot, kv_pools.plot)
        return results
    if config.prefill_formats:
        lens = (list(prefill_formats.PROMPT_LENS) if config.prompt_lens == list(DEFAULT_PROMPT_LENS)
                else config.prompt_lens)
        results = prefill_formats.run(config.model, lens, config.repeat, config.seed)
        prefill_formats.report(results)
        save_results(results, config.json)
        return results
    results = run(config)
    report(results)
    save_results(results, config.json, config.plot, plot)
    if config.profile_out:
        profile = profile_from_phases(results, results["threads"], config.profile_note)
        profile.save(config.profile_out)
        print(f"profile (TP {profile.tensor_parallel_size}, {profile.threads} threads per rank, {profile.cpus} CPUs) "
              f"written to {config.profile_out}: prefill step s = "
              f"{_fit_text(profile.prefill, 'sum(n)', 'sum(n(s+n))')}; decode step s = "
              f"{_fit_text(profile.decode, 'sum(ctx)', 'batch')}")
    return results


def _fit_text(fit, x1: str, x2: str) -> str:
    return f"{fit.a:.3g} + {fit.b:.3g} {x1} + {fit.c:.3g} {x2} (rms error {fit.rms_error * 1e3:.1f} ms)"
