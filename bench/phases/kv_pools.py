"""``splitserve bench phases --kv-pools``: long-context decode in each KV pool format, side by side in one run on one
pinned thread (the acceptance table of issue 46).

Each pool format (``--pool-dtypes``, float16 and int8 by default) gets its own engine. At each point (``--batches`` x
``--contexts``; 1, 16, 64 x 512, 4096 by default) every engine admits ``batch`` sequences of ``context`` tokens as a
decode pod admits transferred ones, every page of their KV written with real values first (a page never written is
the kernel's shared zero page and reads from cache: phases.py). Then ``--repeat`` rounds alternate the engines, each
round ``--steps`` decode steps per engine (median kept), so that load from other work falls on every format alike:
median ms per step over the rounds and its min-max spread. Beside it, the bytes the step must read (every weight
once, every sequence's K and V as the pool stores them, scales included: bench/phases/step_cost.py) and their floor
at the read bandwidth measured in the same run (before and after, the higher), and each format's tokens/s against
the first format's. Last, how many sequences of 4,096 tokens a 1 GiB pool holds in each format. ``--plot`` draws
the steps as bars beside llama.cpp's, each pool's byte floor marked (``plot``). ``--int8-activations`` runs the
engines as a pod with that flag runs (the products over the quantized weights take int8 inputs), so that the batch's
products weigh less beside the attention; the table's title names the weights' format.

``quality`` (``--kv-pool-quality``) measures what each format costs in answers: every position of 1,024-token windows
of GPL-3's text run as one prefill over a pool of that format (each position attends over the K/V as the pool holds
them: what decoding over it attends over), teacher-forced top-1 agreement and perplexity against the float16 pool.
"""

from __future__ import annotations

import math
import random
import statistics
import time

import torch

from splitserve.bench.engine import read_bandwidth
from splitserve.bench.phases import llamacpp_pools
from splitserve.bench.phases.prefill_quality import REFERENCE_TEXT, sequence_logits
from splitserve.bench.phases.sequences import admit_transferred
from splitserve.bench.phases.step_cost import decode_bytes
from splitserve.engine import LLM
from splitserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from splitserve.engine.kernels.cpu_features import cpu_model, matrix_features
from splitserve.engine.kv_cache import num_blocks_for_budget
from splitserve.engine.kv_formats import open_keys
from splitserve.engine.kv_formats import rows as kv_rows
from splitserve.engine.llm_engine import LLMEngine
from splitserve.measure.figures import headless_pyplot, save_figure
from splitserve.measure.pinning import one_pinned_thread

POOL_DTYPES = ("float16", "int8")
BATCHES = (1, 16, 64)
CONTEXTS = (512, 4096)
CAPACITY_TOKENS = 4096  # the sequence length of the capacity column
CAPACITY_BUDGET = 1 << 30
WARMUP_STEPS = 2
QUALITY_WINDOW, QUALITY_WINDOWS = 1024, 4  # tokens per teacher-forced window, windows of GPL-3's text
QUALITY_BASELINE = "float16"  # the pods' default pool, which every format is held against
QUALITY_TARGETS = {"int8": 0.99, "int4": 0.97}  # top-1 agreement (issue 46)


def run(model: str, pool_dtypes: list[str], batches: list[int], contexts: list[int], steps: int, repeat: int,
        seed: int, llamacpp_kv_types: list[str] = (), int8_activations: bool = False, log=print) -> dict:
    """{"cpu": ..., "read_gbps": ..., "points": {"BxC": {dtype: figures}}, "capacity": {dtype: sequences},
    "llamacpp": {...}}, on one pinned thread; llama.cpp's decode over ``llamacpp_kv_types`` after the engines', on
    the same CPU (bench/phases/llamacpp_pools.py)."""
    with one_pinned_thread() as cpu:
        log("measuring the read bandwidth ...")
        read_before = read_bandwidth()
        rounds_total = repeat * (steps + 1) + WARMUP_STEPS
        engines = {d: _engine(model, d, max(batches), max(contexts) + rounds_total + 2, seed, int8_activations)
                   for d in pool_dtypes}
        first = engines[pool_dtypes[0]]
        weights = first.config.weights_format  # the products' format, as the pods report it
        cfg = first.model_config
        weight_bytes = sum(p.numel() * p.element_size() for p in first.runner.model.parameters())
        rng = random.Random(seed)
        points: dict = {}
        grid = [(b, c) for c in contexts for b in batches]
        for i, (batch, context) in enumerate(grid):
            log(f"[{i + 1}/{len(grid)}] batch {batch} x context {context}: writing the KV, then {repeat} rounds of "
                f"{steps} steps per format ...")
            times: dict[str, list[float]] = {d: [] for d in pool_dtypes}
            admitted = {}
            for d, engine in engines.items():
                admitted[d] = admit_transferred(engine, rng, batch, context, max_tokens=rounds_total + 1)
                for _ in range(WARMUP_STEPS):
                    _decode_step(engine)
            for _ in range(repeat):
                for d, engine in engines.items():
                    times[d].append(statistics.median(_decode_step(engine) for _ in range(steps)))
            for d, engine in engines.items():
                for request_id in admitted[d]:
                    engine.abort_request(request_id)
            points[f"{batch}x{context}"] = {
                d: {"batch": batch, "context": context, "ms": [t * 1e3 for t in ts],
                    "bytes_per_step": decode_bytes(cfg, weight_bytes, batch, context,
                                                   engines[d].runner.kv_cache.element_size)}
                for d, ts in times.items()}
        del engines, first  # their pools' memory, before llama.cpp's
        peer = _llamacpp(model, llamacpp_kv_types, batches, contexts, steps, repeat, cpu, seed, log)
        read = max(read_before, read_bandwidth())
    capacity = {d: _sequences_at_budget(cfg, d) for d in pool_dtypes}
    return {"model": cfg.name, "weights": weights, "cpu": cpu_model(), "cpu_features": matrix_features(),
            "read_gbps": read, "pool_dtypes": list(pool_dtypes), "steps": steps, "repeat": repeat, "points": points,
            "capacity": capacity, "llamacpp": peer}


def _llamacpp(model: str, kv_types: list[str], batches: list[int], contexts: list[int], steps: int, repeat: int,
              cpu: int, seed: int, log) -> dict:
    """{"kv_types": {type: {"BxC": [ms]}}}, or {"absent": why} (none asked: {})."""
    if not kv_types:
        return {}
    if why := llamacpp_pools.absence(model):
        log(f"llama.cpp: {why}")
        return {"absent": why}
    return {"kv_types": llamacpp_pools.run(model, list(kv_types), batches, contexts, steps, repeat, cpu, seed, log)}


def report(results: dict, log=print) -> None:
    dtypes = results["pool_dtypes"]
    base = dtypes[0]
    log(f"\n== decode by KV pool format ({results['model']}, weights {results['weights']}; CPU: {results['cpu']}, "
        f"features {results['cpu_features']}; one pinned thread; median [min-max] of {results['repeat']} rounds of "
        f"{results['steps']} steps; read bandwidth {results['read_gbps']:.1f} GB/s) ==")
    log(f"{'batch':>6}{'context':>8}{'pool':>9}{'ms/step':>26}{'MB/step':>9}{'floor ms':>9}{'/ floor':>8}"
        f"{'tok/s vs ' + base:>18}")
    for point in results["points"].values():
        base_ms = statistics.median(point[base]["ms"])
        for d in dtypes:
            r = point[d]
            ms = statistics.median(r["ms"])
            floor = r["bytes_per_step"] / results["read_gbps"] / 1e6
            spread = f"{ms:.2f} [{min(r['ms']):.2f}-{max(r['ms']):.2f}]"
            log(f"{r['batch']:>6}{r['context']:>8}{d:>9}{spread:>26}{r['bytes_per_step'] / 1e6:>9.1f}{floor:>9.2f}"
                f"{ms / floor:>7.2f}x{base_ms / ms:>17.2f}x")
        key = f"{point[base]['batch']}x{point[base]['context']}"
        for kv_type, by_point in results.get("llamacpp", {}).get("kv_types", {}).items():
            if key in by_point:
                ms = statistics.median(by_point[key])
                spread = f"{ms:.2f} [{min(by_point[key]):.2f}-{max(by_point[key]):.2f}]"
                log(f"{'':>14}{'lcpp ' + kv_type:>9}{spread:>26}{'':>26}{base_ms / ms:>17.2f}x")
    capacity = ", ".join(f"{d} {n}" for d, n in results["capacity"].items())
    log(f"sequences of {CAPACITY_TOKENS} tokens a {CAPACITY_BUDGET >> 30} GiB pool holds: {capacity}")
    log("(MB/step: every weight once plus each sequence's K and V as the pool stores them, scales included; floor: "
        "those bytes at the read bandwidth measured in the same run)")
    peer = results.get("llamacpp", {})
    if "absent" in peer:
        log(f"llama.cpp: {peer['absent']}")
    elif peer:
        log("(lcpp T: llama.cpp on the same GGUF file, CPU and thread, its KV cache of type T (flash attention), "
            "measured after the engines: bench/phases/llamacpp_pools.py)")


def _engine(model: str, pool_dtype: str, batch: int, tokens: int, seed: int, int8_activations: bool) -> LLMEngine:
    block = CacheConfig().block_size
    blocks = batch * (math.ceil(tokens / block) + 2) + 16  # (room to grow, and a scaled pool's open block)
    scheduler = SchedulerConfig(max_num_seqs=max(SchedulerConfig().max_num_seqs, batch))
    return LLMEngine(EngineConfig(model=model, seed=seed, scheduler=scheduler, int8_activations=int8_activations,
                                  cache=CacheConfig(num_blocks=blocks, cache_dtype=pool_dtype,
                                                    enable_prefix_caching=False)))


def _decode_step(engine: LLMEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def _sequences_at_budget(cfg: ModelConfig, pool_dtype: str) -> int:
    block = CacheConfig().block_size
    dtype = kv_rows.pool_dtype(pool_dtype)
    blocks = num_blocks_for_budget(cfg, block, dtype, CAPACITY_BUDGET)
    return blocks // (math.ceil(CAPACITY_TOKENS / block) + open_keys.used_by(dtype))  # (a scaled pool's open block)


def quality_windows(llm: LLM) -> list[list[int]]:
    """The token windows the quality runs teacher-force: ``QUALITY_WINDOWS`` of ``QUALITY_WINDOW`` tokens of GPL-3's
    text (fewer where the text is shorter)."""
    if not REFERENCE_TEXT.is_file():
        raise RuntimeError(f"{REFERENCE_TEXT} is missing: the quality runs read its text")
    tokens = llm.tokenizer.encode(REFERENCE_TEXT.read_text())
    windows = [tokens[i:i + QUALITY_WINDOW] for i in range(0, len(tokens) - QUALITY_WINDOW + 1, QUALITY_WINDOW)]
    return windows[:QUALITY_WINDOWS]


def top1_agreement(logits: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The share of the windows' positions whose most likely next token is the reference's."""
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(logits, reference))
    return agree / sum(len(x) for x in reference)


def perplexity(logits: list[torch.Tensor], windows: list[list[int]]) -> float:
    """exp(mean over the windows of each one's next-token NLL)."""
    nll = [torch.nn.functional.cross_entropy(x[:-1], torch.tensor(w[1:])) for x, w in zip(logits, windows)]
    return torch.stack(nll).mean().exp().item()


def quality(model: str, pool_dtypes: list[str], prefill_compute_dtype: str = "auto", log=print) -> dict:
    """{"positions", "windows", "prefill_compute", "formats": {dtype: {"top1_agreement", "perplexity",
    "ppl_change_pct"}}} against the float16 pool, over ``quality_windows``, each window prefilled in
    ``prefill_compute_dtype`` (a pod's flag: auto is the pods' default)."""
    llm = LLM(model=model, kv_cache_memory_bytes=64 << 20, prefill_compute_dtype=prefill_compute_dtype)
    windows = quality_windows(llm)
    formats = [QUALITY_BASELINE] + [d for d in pool_dtypes if d != QUALITY_BASELINE]
    logits: dict[str, list[torch.Tensor]] = {}
    for d in formats:
        log(f"quality: {len(windows)} windows of {QUALITY_WINDOW} tokens over a {d} pool ...")
        logits[d] = [sequence_logits(llm, w, d) for w in windows]
    base_ppl = perplexity(logits[QUALITY_BASELINE], windows)
    results: dict = {"positions": sum(len(w) for w in windows), "windows": len(windows),
                     "prefill_compute": llm.engine.prefill_compute, "formats": {}}
    for d in formats:
        ppl = perplexity(logits[d], windows)
        results["formats"][d] = {"top1_agreement": top1_agreement(logits[d], logits[QUALITY_BASELINE]),
                                 "perplexity": ppl, "ppl_change_pct": 100 * (ppl / base_ppl - 1)}
    return results


def plot(results: dict, path: str) -> None:
    """``--plot``: ms per decode step at each point, a bar per pool format and per llama.cpp KV type (median, the
    rounds' min-max as whiskers), each pool's byte floor a dash over its bar; log scale, lower is faster."""
    plt = headless_pyplot()
    peer = results.get("llamacpp", {}).get("kv_types", {})
    series = [(d, {k: point[d]["ms"] for k, point in results["points"].items()}) for d in results["pool_dtypes"]]
    series += [(f"llama.cpp {t}", by_point) for t, by_point in peer.items()]
    keys = list(results["points"])
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.4 * len(keys)), 4.5))
    for i, (name, by_point) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, k in enumerate(keys) if k in by_point]
        rounds = [by_point[k] for k in keys if k in by_point]
        medians = [statistics.median(r) for r in rounds]
        whiskers = [[m - min(r) for m, r in zip(medians, rounds)], [max(r) - m for m, r in zip(medians, rounds)]]
        ax.bar(xs, medians, width, yerr=whiskers, capsize=2, label=name)
        if name in results["pool_dtypes"]:
            floors = [results["points"][k][name]["bytes_per_step"] / results["read_gbps"] / 1e6 for k in keys]
            ax.hlines(floors, [x - width / 2 for x in xs], [x + width / 2 for x in xs], colors="black")
    ax.set_xticks(range(len(keys)), [k.replace("x", " x ") for k in keys])
    ax.set_yscale("log")
    ax.set_xlabel("batch x context (tokens)")
    ax.set_ylabel("ms per decode step (log)")
    ax.set_title(f"Decode by KV pool format, one pinned thread ({results['cpu']}); dashes: each pool's byte floor",
                 fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path)


def report_quality(results: dict, log=print) -> None:
    log(f"\n== KV pool formats' quality against the {QUALITY_BASELINE} pool (teacher-forced top-1 over "
        f"{results['positions']} positions of {results['windows']} windows of {QUALITY_WINDOW} tokens of GPL-3, "
        f"prefill in {results['prefill_compute']}) ==")
    log(f"{'pool':<10}{'top-1':>9}{'perplexity':>12}{'change':>9}  target")
    for d, r in results["formats"].items():
        target = QUALITY_TARGETS.get(d)
        met = target is not None and r["top1_agreement"] >= target
        verdict = "" if target is None else f"top-1 >= {target:.0%}: {'met' if met else 'MISSED'}"
        log(f"{d:<10}{r['top1_agreement']:>9.2%}{r['perplexity']:>12.3f}{r['ppl_change_pct']:>+8.2f}%  {verdict}")
