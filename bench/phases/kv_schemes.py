"""``splitserve bench phases --kv-schemes``: KV formats *simulated* on the model before any is built, teacher-forced
top-1 agreement and perplexity against the float16 pool (the ``--kv-pool-quality`` windows of GPL-3), and each
one's bytes per value and sequences of 4,096 tokens per GiB against float16's.

The model runs on the PyTorch path (``cpu_kernels=False``, float32 prefill, float weights), one window as one prefill,
each layer's attention replaced by ``_attend``: the window's K/V rounded as a scheme stores them, each query reading the
keys before it as the scheme would serve them. A *window* of the newest keys kept in float16 beside the quantized blocks
is part of a scheme: ``"block"`` (each query reads the keys of its own 16-token block, the block still being filled, in
float16, and every older block quantized; values quantized everywhere), a number of tokens (each query reads the keys
and values of its last that many positions in float16, KIVI's residual) or ``"N blocks"`` (the keys and values of the
query's own block and the N - 1 blocks before it in float16: KIVI's residual as a paged pool would keep it, whole
blocks). Which of these a pool could serve, and at what cost, is docs/kv_cache.md's question; this measures what each
would answer. ``float16`` is the simulation's control (the float16 pool's rounding on this harness), ``int8-g16-block``
the ``int8`` pool as built (its rows, a scale per 16 channels, ``kv_rows.store`` bit for bit, each query's own block of
keys in float16: engine/kv_formats/open_keys.py), against which the harness is checked; ``int8-row`` and
``int8-row-block`` the pool's earlier rows (one scale per row, rounded up to float16 as the pool rounds), without and
with the own block.

Scales: symmetric ones are the largest magnitude over the code range; asymmetric ones (``asym``) a minimum and a
step, both stored as float16 (``--kv-pool-quality``'s int8 rows round theirs up; here all round to nearest).
Keys ``per channel`` share a scale per (16-token block, head, channel); ``per row`` a scale per (token, head) or per
group of channels in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.bench.phases.kv_pools import (
    CAPACITY_TOKENS,
    QUALITY_WINDOW,
    perplexity,
    quality_windows,
    top1_agreement,
)
from splitserve.engine import LLM
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.kv_formats import rows as kv_rows
from splitserve.engine.kv_formats.scales import divide, round_up_to_float16
from splitserve.engine.model.attention import AttentionMetadata

BLOCK = 16  # tokens per pool block: the group of a key channel's scale

Quantizer = Callable[[torch.Tensor], torch.Tensor]  # [n, Hkv, D] float32 -> the values a scheme reads back


def _symmetric(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    top = (1 << (bits - 1)) - 1
    scale = (x.abs().amax(dim=dim, keepdim=True) / top).half().float()
    return (x / scale.clamp_min(1e-30)).round().clamp(-top, top) * scale


def _power_of_two(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Symmetric, the scale rounded up to a power of two: one byte of exponent (E8M0, as the MX formats store it)."""
    top = (1 << (bits - 1)) - 1
    scale = torch.exp2(torch.ceil(torch.log2((x.abs().amax(dim=dim, keepdim=True) / top).clamp_min(1e-30))))
    return (x / scale).round().clamp(-top, top) * scale


def _asymmetric(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    low, high = x.amin(dim=dim, keepdim=True).half().float(), x.amax(dim=dim, keepdim=True).half().float()
    step = ((high - low) / ((1 << bits) - 1)).clamp_min(1e-30)
    return ((x - low) / step).round().clamp(0, (1 << bits) - 1) * step + low


def _per_row(round_trip, bits: int, group: int = 0) -> Quantizer:
    def quantize(x: torch.Tensor) -> torch.Tensor:
        n, heads, dim = x.shape
        return round_trip(x.view(n, heads, -1, group or dim), bits, -1).view(n, heads, dim)
    return quantize


def _per_channel(round_trip, bits: int) -> Quantizer:
    """A scale per (16-token block, head, channel); a last partial block's over its tokens."""
    def quantize(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([round_trip(block, bits, 0) for block in x.split(BLOCK)])
    return quantize


def _int8_pool(x: torch.Tensor) -> torch.Tensor:
    """The int8 pool's rows, as it stores them."""
    return kv_rows.load(kv_rows.store(x, torch.int8))


def _int8_rows(x: torch.Tensor) -> torch.Tensor:
    """int8 rows with one scale per row, rounded up to float16 (the int8 pool's rows before its group scales)."""
    scale = round_up_to_float16(divide(x.abs().amax(-1, keepdim=True), 127.0)).float()
    return (x / torch.where(scale > 0, scale, 1.0)).round().clamp(-127, 127) * scale


def _e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    scale = (x.abs().amax(-1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max).half().float().clamp_min(1e-30)
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


@dataclass(frozen=True)
class Scheme:
    keys: Quantizer | None  # None: float16
    values: Quantizer | None
    key_bytes: float  # bytes per stored value at head_dim 64, scales included
    value_bytes: float
    window: str | int | None = None  # "block", a number of tokens, "N blocks", or None (docstring above)


_INT4_CHANNEL = Scheme(_per_channel(_asymmetric, 4), _per_row(_asymmetric, 4, 16), 0.5 + 4 / BLOCK, 0.5 + 4 / 16,
                       "block")
_INT4_ROW_G16 = Scheme(_per_row(_asymmetric, 4, 16), _per_row(_asymmetric, 4, 16), 0.5 + 4 / 16, 0.5 + 4 / 16, "block")
_INT4_ROW_G8 = Scheme(_per_row(_asymmetric, 4, 8), _per_row(_asymmetric, 4, 8), 0.5 + 4 / 8, 0.5 + 4 / 8, "block")
SCHEMES: dict[str, Scheme] = {
    "float16": Scheme(None, None, 2, 2),
    "int8-row": Scheme(_int8_rows, _int8_rows, 1 + 2 / 64, 1 + 2 / 64),
    # one scale per row, and the query's own block of keys read in float16 (the window alone, no channel scales)
    "int8-row-block": Scheme(_int8_rows, _int8_rows, 1 + 2 / 64, 1 + 2 / 64, "block"),
    "int8-key-g32": Scheme(_per_row(_symmetric, 8, 32), _int8_rows, 1 + 4 / 64, 1 + 2 / 64),  # rows, finer key scales
    "int8-key-g16": Scheme(_per_row(_symmetric, 8, 16), _int8_rows, 1 + 8 / 64, 1 + 2 / 64),
    "int8-key-g8": Scheme(_per_row(_symmetric, 8, 8), _int8_rows, 1 + 16 / 64, 1 + 2 / 64),
    # finer key scales in self-contained rows, and the query's own block of keys read in float16
    "int8-key-g32-block": Scheme(_per_row(_symmetric, 8, 32), _int8_rows, 1 + 4 / 64, 1 + 2 / 64, "block"),
    "int8-key-g16-block": Scheme(_per_row(_symmetric, 8, 16), _int8_rows, 1 + 8 / 64, 1 + 2 / 64, "block"),
    # the int8 pool: keys and values alike, a float16 scale per 16 channels of a row; the own block of keys
    "int8-g16-block": Scheme(_int8_pool, _int8_pool, 1 + 8 / 64, 1 + 8 / 64, "block"),
    "int8-channel": Scheme(_per_channel(_symmetric, 8), _int8_rows, 1 + 2 / BLOCK, 1 + 2 / 64, "block"),
    "int8-channel-e8m0": Scheme(_per_channel(_power_of_two, 8), _int8_rows, 1 + 1 / BLOCK, 1 + 2 / 64, "block"),
    "fp8-e4m3-row": Scheme(_e4m3_rows, _e4m3_rows, 1 + 2 / 64, 1 + 2 / 64),
    "int4-row-g32": Scheme(_per_row(_asymmetric, 4, 32), _per_row(_asymmetric, 4, 32), 0.5 + 4 / 32, 0.5 + 4 / 32),
    # 4-bit self-contained rows (the int8 pool's form at 4 bits: a minimum and a step per group of a row), with the
    # own block of keys or a window of K and V in float16
    "int4-row-g16-block": _INT4_ROW_G16,
    "int4-row-g8-block": _INT4_ROW_G8,
    "int4-row-g16-w64": dataclasses.replace(_INT4_ROW_G16, window=64),
    "int4-row-g16-w128": dataclasses.replace(_INT4_ROW_G16, window=128),
    "int4-row-g8-w128": dataclasses.replace(_INT4_ROW_G8, window=128),
    # one side at 8 bits, the other at 4 (llama.cpp's type_k / type_v apart)
    "k8-v4-g16-block": Scheme(_int8_pool, _per_row(_asymmetric, 4, 16), 1 + 8 / 64, 0.5 + 4 / 16, "block"),
    "k8-v4-g32-block": Scheme(_int8_pool, _per_row(_asymmetric, 4, 32), 1 + 8 / 64, 0.5 + 4 / 32, "block"),
    "k4-channel-v8-block": Scheme(_per_channel(_asymmetric, 4), _int8_pool, 0.5 + 4 / BLOCK, 1 + 8 / 64, "block"),
    "int4-channel": _INT4_CHANNEL,
    "int4-kivi-64": dataclasses.replace(_INT4_CHANNEL, window=64),  # KIVI-4 with its float16 residual
    "int4-kivi-128": dataclasses.replace(_INT4_CHANNEL, window=128),
    # the window as whole blocks, as a paged pool would keep it: the query's own block and the 7 before (113-128 tokens)
    "int4-kivi-8-blocks": dataclasses.replace(_INT4_CHANNEL, window="8 blocks"),
}


def capacity_ratio(scheme: Scheme) -> float:
    """Sequences of 4,096 tokens per GiB against float16's: its bytes per value, the float16 window's included (one
    block for ``"block"``, as a pool would keep the block being filled)."""
    window = _window_blocks(scheme) * BLOCK if isinstance(scheme.window, str) else scheme.window or 0
    stored = (scheme.key_bytes + scheme.value_bytes) * (CAPACITY_TOKENS - window) + 4 * window
    return 4 * CAPACITY_TOKENS / stored


def _window_blocks(scheme: Scheme) -> int:
    """The blocks of a block window: "block" (keys only) is one, "N blocks" N."""
    return 1 if scheme.window == "block" else int(scheme.window.removesuffix(" blocks"))


def _read_as(x: torch.Tensor, quantize: Quantizer | None) -> torch.Tensor:
    return x.half().float() if quantize is None else quantize(x.float())


def _attend(attn, scheme: Scheme):
    """``Attention.attend`` for one sequence from position 0, its K/V read as ``scheme`` serves them."""
    def attend(qk, qkv, k_cache, v_cache, meta, kv_written):
        if attn.window is not None or attn.softcap is not None:
            raise ValueError("--kv-schemes simulates full-attention layers only (no window, no soft-cap)")
        n, group = len(qkv), attn.num_heads // attn.num_kv_heads
        q = qk[:, : attn.num_heads].float().transpose(0, 1)  # [Hq, n, D]
        k = qk[:, attn.num_heads:].float()
        v = qkv[:, attn.qk_size:].view(n, attn.num_kv_heads, attn.head_dim).float()
        heads = lambda x: x.repeat_interleave(group, 1).transpose(0, 1)  # [n, Hkv, D] -> [Hq, n, D]  # noqa: E731
        k16, v16 = heads(k.half().float()), heads(v.half().float())
        k_old, v_old = heads(_read_as(k, scheme.keys)), heads(_read_as(v, scheme.values))
        pos, key = torch.arange(n)[:, None], torch.arange(n)[None, :]
        if scheme.window == "block":
            k_window, v_window = pos // BLOCK == key // BLOCK, torch.zeros(n, n, dtype=torch.bool)
        elif isinstance(scheme.window, str):
            k_window = v_window = pos // BLOCK - key // BLOCK < _window_blocks(scheme)
        else:
            k_window = v_window = pos - key < (scheme.window or 0)
        scores = torch.where(k_window, q @ k16.transpose(1, 2), q @ k_old.transpose(1, 2)) * attn.scale
        probs = torch.softmax(scores.masked_fill(key > pos, float("-inf")), -1)
        out = (probs * v_window) @ v16 + (probs * ~v_window) @ v_old  # [Hq, n, D]
        return out.transpose(0, 1).reshape(n, attn.q_size).to(qkv.dtype)
    return attend


@torch.inference_mode()
def _logits(llm: LLM, tokens: list[int], scheme: Scheme) -> torch.Tensor:
    model = llm.engine.runner.model
    for layer in model.layers:
        layer.attn.attend = _attend(layer.attn, scheme)
    try:
        n = len(tokens)
        cache = PagedKVCache(model.config, 1, BLOCK, "float32")  # not read: _attend takes the step's own K/V
        meta = AttentionMetadata.build([n], [n], [[0] * -(-n // BLOCK)], BLOCK)
        return model.compute_logits(model(torch.tensor(tokens), torch.arange(n), cache, meta)).float()
    finally:
        for layer in model.layers:
            del layer.attn.attend


def run(model: str, names: list[str], log=print) -> dict:
    """{"positions", "windows", "schemes": {name: {"top1_agreement", "ppl_change_pct", "bytes_per_value",
    "capacity_vs_float16", "window"}}} against the simulated float16 pool."""
    unknown = sorted(set(names) - set(SCHEMES))
    if unknown:
        raise ValueError(f"unknown KV schemes {unknown}; known: {sorted(SCHEMES)}")
    llm = LLM(model=model, quantization="none", cpu_kernels=False, prefill_compute_dtype="float32",
              kv_cache_memory_bytes=16 << 20)
    windows = quality_windows(llm)

    def measured(name: str) -> list[torch.Tensor]:
        log(f"kv schemes: {name} over {len(windows)} windows of {QUALITY_WINDOW} tokens ...")
        return [_logits(llm, w, SCHEMES[name]) for w in windows]

    base = measured("float16")
    base_ppl = perplexity(base, windows)
    results: dict = {"positions": sum(len(w) for w in windows), "windows": len(windows), "schemes": {}}
    for name in ["float16"] + [n for n in names if n != "float16"]:
        logits = base if name == "float16" else measured(name)
        scheme = SCHEMES[name]
        results["schemes"][name] = {
            "top1_agreement": top1_agreement(logits, base),
            "ppl_change_pct": 100 * (perplexity(logits, windows) / base_ppl - 1),
            "bytes_per_value": (scheme.key_bytes + scheme.value_bytes) / 2,
            "capacity_vs_float16": capacity_ratio(scheme), "window": scheme.window}
    return results


def report(results: dict, log=print) -> None:
    log(f"\n== simulated KV schemes against the float16 pool (teacher-forced top-1 over {results['positions']} "
        f"positions of {results['windows']} windows of {QUALITY_WINDOW} tokens of GPL-3; capacity at {CAPACITY_TOKENS} "
        "tokens) ==")
    wide = max(16, *(len(name) + 1 for name in results["schemes"]))
    log(f"{'scheme':<{wide}}{'window':>8}{'top-1':>9}{'ppl':>9}{'B/value':>9}{'capacity':>10}")
    for name, r in results["schemes"].items():
        log(f"{name:<{wide}}{str(r['window'] or '-'):>8}{r['top1_agreement']:>9.2%}{r['ppl_change_pct']:>+8.2f}%"
            f"{r['bytes_per_value']:>9.3f}{r['capacity_vs_float16']:>9.2f}x")
