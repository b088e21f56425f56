"""Tensor parallelism on this machine (``splitserve bench tp``): TP 1 against TP N on the same cores, the
collectives a step runs, and what the measured communication model projects for a node of 8 devices.

One engine at a time, for each of ``--tensor-parallel-sizes`` (1 and 2 by default; TP N splits the cores this
process may run on among its ranks, one thread per core, engine/parallel/workers.py; TP 1 runs once per
``--tp1-threads``, 1 and 2 by default), over ``--rounds`` rounds:

- prefill tokens/s of one prompt of ``--prompt-len`` tokens;
- decode ms per step at each of ``--batches`` (sequences decoding together) over ``--context`` tokens of context,
  the median of ``--steps`` steps;
- the KV hand-off of that prompt on the engine's side, ms per prompt: what a prefill pod's export reads (every
  layer's K and V, at TP N each rank's heads apart, read_heads) and what a decode pod's receiver writes back
  (write_heads, each range into the ranks that hold it); engine/parallel/sharded_kv_cache.py;
- with TP > 1, what rank 0's collectives did per decode step: calls, bytes (its own payload) and seconds inside them
  (waiting for a slower rank included);

each as the median over the rounds with the min-max beside it. Then, on the largest TP, the communication model of each
transport the group has (the shared-memory all-reduce, engine/parallel/shm_all_reduce.py, and gloo's): rank 0's
all-reduce of 1, 8 and 64 rows of the hidden size, timed ``ALL_REDUCE_REPEATS`` times each, fitted as
``seconds = alpha + bytes / bandwidth``; and, per transport, the projection of a batch-1 decode step at t ranks: TP 1's
step at one thread (one device's compute) / t (the weights' reads split evenly, the best case) plus ``2 L + 2``
collectives a step (two per layer, the embedding's and the logits' gather) at that transport's cost for t ranks
(``collective_seconds``). It prints the per-collective cost below which TP t would beat TP 1, and gloo's all-to-all of
the same payloads against the all-reduce (``expert_dispatch``: why expert parallelism rides on the all-reduce).
The figures move with the machine's load; docs/PERFORMANCE.md has a run with the CPU named.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.config import DEFAULT_MODEL, QUANTIZATIONS
from splitserve.engine.kernels.cpu_features import matrix_features
from splitserve.engine.kv_cache import KV_KINDS
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.parallel.sharded_kv_cache import read_heads, write_heads
from splitserve.measure.figures import FiguresOutput, headless_pyplot, save_figure, save_results
from splitserve.runtime.config import described, parse_config

ALL_REDUCE_ROWS = (1, 8, 64)
ALL_REDUCE_REPEATS = 100
PROJECTED_RANKS = (2, 4, 8)


@dataclass
class TensorParallelBenchConfig(FiguresOutput):
    """TP 1 against TP N on this machine's cores, and the projection to 8 devices."""

    model: str = field(default=DEFAULT_MODEL, metadata=described("Model to load (tiny-random for a quick run)."))
    quantization: str = field(default="none", metadata=described(
        f"Weights' format, one of {', '.join(QUANTIZATIONS)} (none: float32, as the TP acceptance tests)."))
    tensor_parallel_sizes: list[int] = field(default_factory=lambda: [1, 2], metadata=described(
        "Tensor-parallel sizes to run, one engine each."))
    tp1_threads: list[int] = field(default_factory=lambda: [1, 2], metadata=described(
        "Thread counts of the TP 1 engine (1: one core's compute, the per-device baseline of the projection)."))
    batches: list[int] = field(default_factory=lambda: [1, 8], metadata=described("Decode batch sizes."))
    context: int = field(default=256, metadata=described("Tokens of context of each decoding sequence."))
    steps: int = field(default=16, metadata=described("Decode steps timed per batch and round."))
    prompt_len: int = field(default=512, metadata=described("Tokens of the prefill prompt."))
    rounds: int = field(default=3, metadata=described("Rounds per engine (median and min-max over them)."))

    def __post_init__(self) -> None:
        if not self.tensor_parallel_sizes or min(self.tensor_parallel_sizes) < 1:
            raise ValueError(f"tensor_parallel_sizes must be >= 1, got {self.tensor_parallel_sizes}")
        if not self.tp1_threads or min(self.tp1_threads) < 1:
            raise ValueError(f"tp1_threads must be >= 1, got {self.tp1_threads}")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"batches must be >= 1, got {self.batches}")
        if min(self.context, self.steps, self.prompt_len, self.rounds) < 1:
            raise ValueError("context, steps, prompt_len and rounds must be >= 1")


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _prompt(vocab: int, length: int, stream: int) -> list[int]:
    return [(97 * stream * (k + 1) + 13 * k) % vocab for k in range(length)]


def prefill_seconds(llm: LLM, prompt_len: int, stream: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(_prompt(llm.engine.model_config.vocab_size, prompt_len, stream), params)
    return time.perf_counter() - started


def decode_round(engine: LLMEngine, batch: int, context: int, steps: int, stream: int) -> tuple[float, dict]:
    """Median seconds of ``steps`` decode steps of ``batch`` sequences, and rank 0's collectives per step."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    seqs = [engine.add_request(f"tp-{stream}-{i}", _prompt(vocab, context, stream * 1000 + i), params)
            for i in range(batch)]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    group = getattr(engine.runner.model, "group", None)
    before = (group.counts.calls, group.counts.bytes, group.counts.seconds) if group else (0, 0, 0.0)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    after = (group.counts.calls, group.counts.bytes, group.counts.seconds) if group else (0, 0, 0.0)
    while engine.has_unfinished_requests():
        engine.step()
    calls, nbytes, seconds = ((b - a) / steps for a, b in zip(before, after))
    return statistics.median(times), {"calls": calls, "bytes": nbytes, "seconds": seconds}


def kv_handoff_ms(engine: LLMEngine, tokens: int, repeats: int) -> dict:
    """The engine's side of one prompt's KV hand-off of ``tokens`` tokens, ms per prompt: "read", what a prefill
    pod's export reads (every layer's K and V at its slots, as it leaves: one process's every head, a TP N pod's
    rank head ranges apart); "write", what a decode pod's receiver writes (the same ranges back)."""
    cache, slots = engine.runner.kv_cache, torch.arange(tokens)
    full = (0, engine.model_config.num_kv_heads)
    reads, writes = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        parts = [(layer, kind, read_heads(cache, layer, kind, slots))
                 for layer in range(engine.model_config.num_layers) for kind in KV_KINDS]
        reads.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        for layer, kind, ranges in parts:
            for heads, values in ranges:
                write_heads(cache, layer, kind, slots, values, heads or full)
        writes.append((time.perf_counter() - started) * 1e3)
    return {"read": spread(reads), "write": spread(writes)}


def run_size(config: TensorParallelBenchConfig, tp: int, log) -> dict:
    """One engine of ``tp`` ranks (TP N: one thread per core of each rank's share; TP 1: torch's thread count)."""
    llm = LLM(config.model, quantization=config.quantization, tensor_parallel_size=tp,
              kv_cache_memory_bytes=256 << 20, prefill_compute_dtype="float32")  # TP N's: one format throughout
    engine = llm.engine
    prefill_seconds(llm, config.prompt_len, 0)  # warm-up: first-call costs (allocations, page faults) untimed
    decode_round(engine, max(config.batches), config.context, 2, 0)
    prefill, decode, collectives = [], {b: [] for b in config.batches}, {b: [] for b in config.batches}
    for r in range(config.rounds):
        prefill.append(config.prompt_len / prefill_seconds(llm, config.prompt_len, r + 1))
        for b in config.batches:
            seconds, per_step = decode_round(engine, b, config.context, config.steps, r + 1)
            decode[b].append(seconds * 1e3)
            collectives[b].append(per_step)
    result = {"prefill_tokens_s": spread(prefill),
              "kv_handoff_ms": kv_handoff_ms(engine, config.prompt_len, 5 * config.rounds),
              "decode_ms": {b: spread(v) for b, v in decode.items()},
              "collectives_per_step": {b: {k: statistics.median(c[k] for c in v) for k in v[0]}
                                       for b, v in collectives.items()},
              "shape": {"num_layers": engine.model_config.num_layers, "hidden_size": engine.model_config.hidden_size}}
    label = f"TP {tp}" if tp > 1 else f"TP 1, {torch.get_num_threads()} thread(s)"
    log(f"{label}: prefill {_fmt(result['prefill_tokens_s'], '.0f')} tokens/s; decode ms/step " + ", ".join(
        f"batch {b} {_fmt(s, '.1f')}" for b, s in result["decode_ms"].items())
        + f"; a prompt's KV read {_fmt(result['kv_handoff_ms']['read'], '.1f')} ms, written "
        + f"{_fmt(result['kv_handoff_ms']['write'], '.1f')} ms")
    if tp > 1:
        for b, c in result["collectives_per_step"].items():
            log(f"  batch {b}: {c['calls']:.0f} collectives/step, {c['bytes'] / 1024:.0f} KiB, "
                f"{c['seconds'] * 1e3:.2f} ms in them")
        result["comm_model"] = communication_model(engine.runner.model, engine.model_config.hidden_size, log)
        result["expert_dispatch"] = expert_dispatch(engine.runner.model, engine.model_config.hidden_size,
                                                    result["comm_model"], log)
    del llm, engine
    gc.collect()  # stops the ranks before the next engine takes the cores
    return result


def communication_model(model, hidden_size: int, log) -> dict:
    """Per transport the group has (shared memory, gloo): the all-reduce's fitted latency and bandwidth."""
    transports = {"shm": "auto", "gloo": "gloo"} if model.group.all_reduce_transport == "shm" else {"gloo": "gloo"}
    models = {}
    for name, transport in transports.items():
        points = []
        for rows in ALL_REDUCE_ROWS:
            numel = rows * hidden_size
            seconds = statistics.median(model.time_all_reduce(numel, ALL_REDUCE_REPEATS, transport))
            points.append((numel * 4, seconds))
            log(f"  {name} all-reduce of {rows} x {hidden_size} float32 ({numel * 4 / 1024:.1f} KiB): "
                f"{seconds * 1e6:.0f} us (median of {ALL_REDUCE_REPEATS})")
        (b0, s0), (b1, s1) = points[0], points[-1]
        per_byte = max((s1 - s0) / (b1 - b0), 0.0)  # none resolved: latency-bound at these sizes
        alpha = max(s0 - b0 * per_byte, 0.0)
        bandwidth = 1 / per_byte if per_byte else None
        log(f"  {name} model: alpha {alpha * 1e6:.1f} us + " + (
            f"bytes at {bandwidth / 1e9:.2f} GB/s" if bandwidth else "no resolved byte cost (latency-bound)"))
        models[name] = {"ranks": model.group.size, "alpha_s": alpha, "bandwidth_bytes_s": bandwidth, "points": points}
    return models


def expert_dispatch(model, hidden_size: int, models: dict, log) -> list[tuple[int, float]]:
    """gloo's all-to-all of the same payloads, against the all-reduce: what an expert-parallel dispatch of routed
    tokens would cost. A mixture-of-experts layer over the TP ranks ends with one all-reduce of its [T, H] output
    (engine/model/moe.py); dispatching its tokens instead takes two all-to-alls of k T H (the routed rows to their
    experts' ranks, their outputs back) and an all-gather of the result, so where one all-to-all of T H already costs
    more than the all-reduce, the all-reduce is the cheaper design at any k."""
    best = min(models, key=lambda name: models[name]["points"][-1][1])  # the group's faster transport
    points = []
    for rows, (_, reduce_s) in zip(ALL_REDUCE_ROWS, models[best]["points"]):
        numel = rows * hidden_size * model.group.size  # divisible by the ranks: equal parts
        seconds = statistics.median(model.time_all_to_all(numel, ALL_REDUCE_REPEATS))
        points.append((numel * 4, seconds))
        reduce_s = statistics.median(model.time_all_reduce(numel, ALL_REDUCE_REPEATS,
                                                           "auto" if best == "shm" else "gloo"))
        log(f"  gloo all-to-all of {rows * model.group.size} x {hidden_size} float32: {seconds * 1e6:.0f} us "
            f"against the {best} all-reduce of the same {reduce_s * 1e6:.0f} us ({seconds / reduce_s:.1f}x): "
            f"expert parallelism {'over the all-reduce' if seconds >= reduce_s else 'by all-to-all may pay'}")
    return points


def collective_seconds(transport: str, fit: dict, t: int, payload: int) -> float:
    """One all-reduce of ``payload`` bytes over ``t`` ranks from a fit measured on ``fit["ranks"]``: gloo's ring
    takes 2 (t - 1) hops of latency (the fit's alpha being 2 (ranks - 1) of them) and moves 2 (t - 1) / t of the
    payload; the shared-memory one is one barrier (alpha, whatever t) and each rank reads the t - 1 other slots."""
    alpha, measured = fit["alpha_s"], fit["ranks"]
    per_byte = 1 / fit["bandwidth_bytes_s"] if fit["bandwidth_bytes_s"] else 0.0
    if transport == "shm":
        return alpha + (t - 1) * payload * per_byte
    return (t - 1) / (measured - 1) * alpha + 2 * (t - 1) / t * payload * per_byte


def projection(results: dict, log) -> dict:
    """Batch-1 decode step at t ranks from TP 1's measured step at one thread and each fitted communication
    model."""
    comm = next((r["comm_model"] for r in results.values() if "comm_model" in r), None)
    if "tp1-1t" not in results or comm is None:
        return {}
    one = results["tp1-1t"]  # one core's compute: the per-device baseline
    step1 = one["decode_ms"][min(one["decode_ms"])]["median"] / 1e3
    shape = one["shape"]
    collectives = 2 * shape["num_layers"] + 2
    payload = shape["hidden_size"] * 4
    out = {}
    for name, fit in comm.items():
        out[name] = {}
        for t in PROJECTED_RANKS:
            per_call = collective_seconds(name, fit, t, payload)
            step = step1 / t + collectives * per_call
            budget = step1 * (1 - 1 / t) / collectives
            out[name][t] = {"step_ms": step * 1e3, "collective_us": per_call * 1e6,
                            "break_even_collective_us": budget * 1e6}
            log(f"projected TP {t} on {name}'s model: {step * 1e3:.2f} ms/step against one device's {step1 * 1e3:.2f} "
                f"({collectives} collectives of {per_call * 1e6:.1f} us); TP {t} beats TP 1 below "
                f"{budget * 1e6:.0f} us a collective")
    return out


def _fmt(s: dict, spec: str) -> str:
    return f"{s['median']:{spec}} [{s['min']:{spec}}-{s['max']:{spec}}]"


def main(argv: list[str] | None = None) -> None:
    config = parse_config(TensorParallelBenchConfig, argv, prog="splitserve bench tp")
    log = lambda line: print(line, flush=True)
    cores = sorted(os.sched_getaffinity(0))
    log(f"cores {cores} ({matrix_features()}); model {config.model}, quantization {config.quantization}")
    results = {}
    for tp in config.tensor_parallel_sizes:
        for threads in config.tp1_threads if tp == 1 else [0]:
            saved = torch.get_num_threads()
            torch.set_num_threads(threads or saved)
            results[f"tp1-{threads}t" if tp == 1 else f"tp{tp}"] = run_size(config, tp, log)
            torch.set_num_threads(saved)
    figures = {"cores": cores, "cpu_features": matrix_features(), "model": config.model,
               "quantization": config.quantization, "runs": results, "projection": projection(results, log)}
    save_results(figures, config.json, config.plot, plot)


def plot(figures: dict, path: str) -> None:
    """Batch-1 decode ms per step: measured per TP size, and projected to 8 ranks."""
    plt = headless_pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    measured = {label: r["decode_ms"][min(r["decode_ms"])]["median"] for label, r in figures["runs"].items()}
    projected = {f"TP {t} ({name}, projected)": p["step_ms"]
                 for name, by_size in figures["projection"].items() for t, p in by_size.items()}
    ax.bar(list(measured) + list(projected), list(measured.values()) + list(projected.values()),
           color=["tab:blue"] * len(measured) + ["tab:gray"] * len(projected))
    ax.set_ylabel("decode ms / step, batch 1")
    ax.set_title(f"{figures['model']}: tensor parallelism on {len(figures['cores'])} cores")
    plt.setp(ax.get_xticklabels(), rotation=20)
    save_figure(fig, path)
