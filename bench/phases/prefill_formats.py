"""``splitserve bench phases --prefill-formats``: prefill time per prompt length in each prefill compute format
(float32 and bfloat16, engine/model/bf16_prefill.py), side by side in one run, on one pinned thread and on two,
against the bf16 GEMM peak of the same shapes measured in the same run (the acceptance tables of issues 34 and 43).

For each thread count (the main thread pinned to one CPU for one thread; the first two CPUs this process may use
for two), each format's engine prefills fresh prompts of each length (``--prompt-lens``) as a pod does (the
scheduler's chunks of ``long_prefill_token_threshold`` tokens), ``--repeat`` times after a warm-up, in rounds that
alternate the formats so that load from other work falls on both alike: median seconds and the min-max spread.
The peak: the faster of two bf16 GEMMs of the model's four layer shapes at the chunk's rows, at the same thread
count: torch's (oneDNN, its best kernel for the shape: AMX tiles where the CPU has them) and the kernels' own
(``Bf16Kernels.linear``, the tiling bf16 prefill runs on); a prefill's share of it is its FLOPs
(bench/phases/step_cost.py) over its time, over that rate. The table names the CPU, its matrix features and the bf16
products' ISA.
"""

from __future__ import annotations

import os
import random
import statistics
import time

import torch
import torch.nn.functional as F

from splitserve.bench.phases.sequences import random_prompt
from splitserve.bench.phases.step_cost import prefill_flops
from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.engine.kernels.bf16_kernels import Bf16Kernels, pack
from splitserve.engine.kernels.cpu_features import cpu_model, matrix_features
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling.params import SamplingParams

FORMATS = ("float32", "bfloat16")
PROMPT_LENS = (128, 512, 2048)
THREADS = (1, 2)


def run(model: str, prompt_lens: list[int], repeat: int, seed: int, log=print) -> dict:
    """{"cpu": ..., "threads": {t: {"peak_gflops": {rows: GFLOP/s}, "gemm_gflops": {rows: {"onednn": GFLOP/s,
    "kernels": GFLOP/s}}, "prefill": {format: {n: figures}}}}}."""
    engines = {f: _engine(model, f, max(prompt_lens), seed) for f in FORMATS}
    cfg = engines["float32"].model_config
    kernels = engines["bfloat16"].runner.model.bf16_prefill.kernels
    chunk = SchedulerConfig().long_prefill_token_threshold
    rng = random.Random(seed)
    allowed = sorted(os.sched_getaffinity(0))
    results: dict = {"model": cfg.name, "cpu": cpu_model(), "cpu_features": matrix_features(), "repeat": repeat,
                     "bf16_isa": kernels.isa, "threads": {}}
    try:
        for threads in THREADS:
            if threads > len(allowed):
                log(f"skipping {threads} threads: this process may use {len(allowed)} CPU(s)")
                continue
            os.sched_setaffinity(0, allowed[-1:] if threads == 1 else allowed[:threads])
            torch.set_num_threads(threads)
            chunk_rows = sorted({min(n, chunk) for n in prompt_lens})
            gemm = {rows: _bf16_gemm_gflops(cfg, rows, kernels) for rows in chunk_rows}
            peak = {rows: max(rates.values()) for rows, rates in gemm.items()}
            times: dict = {f: {n: [] for n in prompt_lens} for f in FORMATS}
            for f in FORMATS:  # warm-up: first-use costs (oneDNN's primitives, the kernels' buffers)
                _prefill_seconds(engines[f], random_prompt(rng, cfg, min(prompt_lens)))
            for r in range(repeat):
                log(f"{threads} thread(s), round {r + 1}/{repeat} ...")
                for n in prompt_lens:
                    for f in FORMATS:
                        times[f][n].append(_prefill_seconds(engines[f], random_prompt(rng, cfg, n)))
            results["threads"][threads] = {
                "cpus": allowed[-1:] if threads == 1 else allowed[:threads], "peak_gflops": peak, "gemm_gflops": gemm,
                "prefill": {f: {n: _figures(cfg, n, ts, peak[min(n, chunk)]) for n, ts in by_len.items()}
                            for f, by_len in times.items()},
            }
    finally:
        os.sched_setaffinity(0, allowed)
    return results


def report(results: dict, log=print) -> None:
    log(f"\n== prefill by compute format ({results['model']}; CPU: {results['cpu']}, features "
        f"{results['cpu_features']}, bf16 products on {results['bf16_isa']}; median [min-max] of "
        f"{results['repeat']}) ==")
    log(f"{'threads':>7}{'tokens':>7}{'float32 ms':>22}{'bfloat16 ms':>22}{'speed-up':>9}{'bf16 GEMM':>10}"
        f"{'f32 share':>10}{'bf16 share':>11}")
    for threads, r in results["threads"].items():
        f32, bf16 = r["prefill"]["float32"], r["prefill"]["bfloat16"]
        for n in f32:
            a, b = f32[n], bf16[n]
            log(f"{threads:>7}{n:>7}{_spread(a):>22}{_spread(b):>22}{a['median_ms'] / b['median_ms']:>8.2f}x"
                f"{b['peak_gflops']:>10.0f}{a['share_of_peak']:>10.0%}{b['share_of_peak']:>11.0%}")
    for threads, r in results["threads"].items():
        rates = ", ".join(f"{rows} rows: oneDNN {g['onednn']:.0f}, kernels {g['kernels']:.0f}"
                          for rows, g in r["gemm_gflops"].items())
        log(f"bf16 GEMM GFLOP/s at {threads} thread(s): {rates}")
    log("(bf16 GEMM: the faster of oneDNN's and the kernels' bf16 products of the layers' shapes at the step's rows, "
        "same threads, same run; share: the prefill's FLOPs over its median time, over that rate)")


def _engine(model: str, prefill_compute_dtype: str, longest: int, seed: int) -> LLMEngine:
    blocks = longest // CacheConfig().block_size + 4
    return LLMEngine(EngineConfig(model=model, seed=seed, prefill_compute_dtype=prefill_compute_dtype,
                                  cache=CacheConfig(num_blocks=blocks, enable_prefix_caching=False)))


def _prefill_seconds(engine: LLMEngine, prompt: list[int]) -> float:
    """One prompt run to its first token, step by step as a pod runs it; seconds."""
    engine.add_request(f"prefill-{time.monotonic_ns()}", prompt, SamplingParams(temperature=0, max_tokens=1))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def _bf16_gemm_gflops(cfg: ModelConfig, rows: int, kernels: Bf16Kernels, repeat: int = 5) -> dict[str, float]:
    """GFLOP/s of one layer's four product shapes at ``rows`` rows in bf16, best of ``repeat``: torch's (oneDNN)
    and the kernels' own."""
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    shapes = [(h, q + 2 * cfg.num_kv_heads * cfg.head_dim), (q, h), (h, 2 * cfg.intermediate_size),
              (cfg.intermediate_size, h)]
    pairs = [(torch.randn(rows, k).bfloat16(), torch.randn(n, k).bfloat16()) for k, n in shapes]
    packed = [(x, pack(w), len(w)) for x, w in pairs]
    flops = sum(2 * rows * k * n for k, n in shapes)

    def rate(products) -> float:
        def once() -> float:
            start = time.perf_counter()
            products()
            return time.perf_counter() - start

        once()
        return flops / min(once() for _ in range(repeat)) / 1e9

    return {"onednn": rate(lambda: [F.linear(x, w) for x, w in pairs]),
            "kernels": rate(lambda: [kernels.linear(x, w, n) for x, w, n in packed])}


def _figures(cfg: ModelConfig, n: int, seconds: list[float], peak_gflops: float) -> dict:
    median = statistics.median(seconds)
    gflops = prefill_flops(cfg, n) / median / 1e9
    return {"median_ms": median * 1e3, "min_ms": min(seconds) * 1e3, "max_ms": max(seconds) * 1e3,
            "gflops": gflops, "peak_gflops": peak_gflops, "share_of_peak": gflops / peak_gflops}


def _spread(r: dict) -> str:
    return f"{r['median_ms']:.0f} [{r['min_ms']:.0f}-{r['max_ms']:.0f}]"

