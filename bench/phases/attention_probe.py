"""``splitserve bench phases --attention-probe``: where the decode attention's time goes at long context, per pool
format: reaching memory, or the arithmetic (issue 46's float16 target, 1.4x the step's byte floor).

On one pinned thread, the native decode attention alone (``paged_decode_attention``, the call a decode step makes per
layer) over every layer of the model's shape, ``batch`` sequences of ``context`` keys each, pools full of random
values in the format, three ways:

  scattered   each sequence's blocks at random places in the pool, as a pool that has served for a while holds them
  in order    each sequence's blocks one after another (the hardware prefetcher can follow them)
  resident    every table pointing at the same 8 blocks, which stay in the core's caches: the arithmetic alone

Each the best of ``repeat`` passes over the layers, in thread CPU time (other processes' time slices do not count,
their memory traffic does) and wall time, with the K/V bytes each pass reads at that speed. ``resident`` is the
floor the arithmetic sets whatever the memory does; the gap from ``scattered`` to ``in order`` is what reaching
scattered blocks costs.
"""

from __future__ import annotations

import time

import torch

from splitserve.engine.config import CacheConfig
from splitserve.engine.kernels.cpu_features import cpu_model
from splitserve.engine.kernels.cpu_kernels import choose
from splitserve.engine.kv_formats import rows as kv_rows
from splitserve.engine.weights.model_files import load_model_files
from splitserve.measure.pinning import one_pinned_thread

RESIDENT_BLOCKS = 8
LAYOUTS = ("scattered", "in order", "resident")


def run(model: str, pool_dtypes: list[str], batch: int, context: int, repeat: int, seed: int, log=print) -> dict:
    """{"cpu", "shape", "formats": {dtype: {layout: {"cpu_ms", "wall_ms", "gb_s"}}}} on one pinned thread."""
    kernels = choose(torch.device("cpu"), torch.float32, True).kernels
    if kernels is None:
        raise RuntimeError("the attention probe times the native kernels, which do not run here")
    cfg = load_model_files(model).config
    block = CacheConfig().block_size
    formats = {}
    with one_pinned_thread():
        for dtype in pool_dtypes:
            log(f"attention probe: {dtype} pools, {cfg.num_layers} layers, {batch} x {context} ...")
            formats[dtype] = _probe(kernels, cfg, kv_rows.pool_dtype(dtype), batch, context, block, repeat, seed)
    return {"model": cfg.name, "cpu": cpu_model(), "batch": batch, "context": context, "repeat": repeat,
            "shape": {"layers": cfg.num_layers, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
                      "head_dim": cfg.head_dim}, "formats": formats}


def _probe(kernels, cfg, dtype: torch.dtype, batch: int, context: int, block: int, repeat: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block)
    blocks = batch * per_seq
    width = kv_rows.row_width(dtype, cfg.head_dim)
    shape = (blocks, block, cfg.num_kv_heads, cfg.head_dim)
    pools = [tuple(kv_rows.store(torch.randn(shape, generator=gen), dtype) for _ in range(2))
             for _ in range(cfg.num_layers)]
    tables = {"scattered": torch.randperm(blocks, generator=gen).view(batch, per_seq),
              "in order": torch.arange(blocks).view(batch, per_seq),
              "resident": (torch.arange(blocks) % RESIDENT_BLOCKS).view(batch, per_seq)}
    lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, cfg.num_heads, cfg.head_dim, generator=gen)
    scale = cfg.head_dim ** -0.5
    kv_bytes = cfg.num_layers * 2 * batch * context * cfg.num_kv_heads * width * dtype.itemsize
    figures = {}
    for layout in LAYOUTS:
        cpu_s = wall_s = float("inf")
        for _ in range(repeat):
            wall, cpu = time.perf_counter(), time.thread_time()
            for k, v in pools:
                kernels.paged_decode_attention(q, k, v, tables[layout], lens, scale)
            cpu_s, wall_s = min(cpu_s, time.thread_time() - cpu), min(wall_s, time.perf_counter() - wall)
        figures[layout] = {"cpu_ms": cpu_s * 1e3, "wall_ms": wall_s * 1e3, "gb_s": kv_bytes / cpu_s / 1e9}
    return figures


def report(results: dict, log=print) -> None:
    s = results["shape"]
    log(f"\n== decode attention alone, {results['batch']} x {results['context']} ({results['model']}: {s['layers']} "
        f"layers, {s['heads']} heads / {s['kv_heads']} KV of {s['head_dim']}; CPU: {results['cpu']}; one pinned "
        f"thread; best of {results['repeat']}) ==")
    log(f"{'pool':<9}{'blocks':<11}{'CPU ms':>9}{'wall ms':>9}{'K/V GB/s':>10}")
    for dtype, layouts in results["formats"].items():
        for layout, f in layouts.items():
            log(f"{dtype:<9}{layout:<11}{f['cpu_ms']:>9.1f}{f['wall_ms']:>9.1f}{f['gb_s']:>10.1f}")
    log("(resident: the same 8 blocks for every table, in cache: the arithmetic alone; K/V GB/s: the bytes a pass "
        "reads over its CPU time)")
