"""Which slice of the model each tensor-parallel rank holds, and that slice of the fused state dict.

Megatron's split, over the fused layout of engine/weights/parameter_layout.py (``D`` head dim, ``g`` query heads per
KV head):

    qkv_proj  [(Hq + 2 Hkv) D, H]  column-parallel: the rank's q rows, then its k rows, then its v rows (and bias)
    o_proj    [H, Hq D]            row-parallel: the columns of the rank's q heads; its product is summed over ranks
    gate_up   [2 I, H]             column-parallel: the rank's gate rows, then its up rows
    down      [H, I]               row-parallel: the columns of the rank's intermediate slice; summed over ranks
    embed_tokens, lm_head [V, H]   vocabulary-parallel: the rank's rows of the vocabulary
    norms                          replicated

A mixture-of-experts layer (engine/model/moe.py) is expert-parallel instead of split: each rank holds E / R of its
experts whole (``experts``, as even as the count allows) and the router replicated; every rank routes every token
alike, computes its own experts' rows, and the layer's output is summed over the ranks as a row-parallel product's
is. That is expert parallelism over the tensor-parallel group's all-reduce; ``EngineConfig.moe_dispatch``
"all_to_all" sends the routed tokens to their experts' ranks instead (expert_dispatch.py).
A shared expert (Qwen2-MoE) is a dense MLP: split as ``gate_up`` / ``down`` are, over its own width (``shared``).

Heads go by KV group, so that a rank's query heads attend to its own KV heads: with ``tp <= Hkv`` each rank takes a
contiguous range of KV heads and their ``g`` query heads each; with more ranks than KV heads, each KV head is
replicated on ``tp / Hkv`` ranks (rounded) and its query heads are split among them (vLLM's rule for GQA). Ranges are
as even as the counts allow, not necessarily equal: SmolLM2-135M's 9 query and 3 KV heads split 6 + 3 over two ranks.
The intermediate slice goes in units of 32 (a quantized block's inputs) when ``I`` allows it, so that a row-parallel
weight kept in GGUF blocks is cut on block boundaries; a cut inside a block is refused.

Each rank builds the ordinary model class from ``rank_config`` (its head, intermediate and vocabulary counts), so its
KV cache holds only its KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import pairwise

import torch

from splitserve.engine.config import CacheConfig, ModelConfig
from splitserve.engine.kernels.weight_formats import QUANT_BLOCK
from splitserve.engine.kv_cache import num_blocks_for_budget
from splitserve.engine.weights.quantized_weights import BlockQuantized

Range = tuple[int, int]  # [start, end)


@dataclass(frozen=True)
class RankShard:
    """Rank ``rank`` of ``size``: the query heads, KV heads, intermediate units and vocabulary rows it holds."""

    rank: int
    size: int
    q_heads: Range
    kv_heads: Range
    intermediate: Range
    vocab: Range
    experts: Range = (0, 0)  # a mixture of experts' experts the rank holds whole (expert parallelism)
    shared: Range = (0, 0)  # its shared expert's intermediate slice (Qwen2-MoE), split as the dense MLP's


def even_ranges(n: int, parts: int, unit: int = 1) -> list[Range]:
    """[0, n) cut into ``parts`` contiguous ranges of whole ``unit``s, sizes differing by at most one unit."""
    units = n // unit
    sizes = [units // parts + (i < units % parts) for i in range(parts)]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size * unit)
    return list(pairwise(bounds))


def plan_shards(config: ModelConfig, tp: int) -> list[RankShard]:
    """Every rank's shard of ``config``'s model over ``tp`` ranks; ValueError when the model cannot be split so."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if tp > config.num_heads:
        raise ValueError(f"tensor_parallel_size {tp} exceeds the model's {config.num_heads} attention heads: a rank "
                         "would hold none")
    unit = QUANT_BLOCK if config.intermediate_size % QUANT_BLOCK == 0 else 1
    if config.intermediate_size // unit < tp:
        raise ValueError(f"intermediate_size {config.intermediate_size} cannot be split over {tp} ranks")
    heads = _head_ranges(config.num_heads, config.num_kv_heads, tp)
    inter = even_ranges(config.intermediate_size, tp, unit)
    vocab = even_ranges(config.vocab_size, tp)
    experts = even_ranges(config.num_experts, tp)
    shared_size = config.shared_expert_intermediate_size
    shared = even_ranges(shared_size, tp, QUANT_BLOCK if shared_size % QUANT_BLOCK == 0 else 1)
    return [RankShard(r, tp, q, kv, inter[r], vocab[r], experts[r], shared[r]) for r, (q, kv) in enumerate(heads)]


def _head_ranges(num_heads: int, num_kv_heads: int, tp: int) -> list[tuple[Range, Range]]:
    group = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        return [((a * group, b * group), (a, b)) for a, b in even_ranges(num_kv_heads, tp)]
    ranks_of = [[r for r in range(tp) if r * num_kv_heads // tp == h] for h in range(num_kv_heads)]
    out = []
    for h, ranks in enumerate(ranks_of):
        for a, b in even_ranges(group, len(ranks)):
            out.append(((h * group + a, h * group + b), (h, h + 1)))
    return out


def rank_config(config: ModelConfig, shard: RankShard) -> ModelConfig:
    """The model config of ``shard``'s rank: its heads, intermediate slice and vocabulary rows; the same head_dim."""
    span = lambda r: r[1] - r[0]
    return replace(config, num_heads=span(shard.q_heads), num_kv_heads=span(shard.kv_heads),
                   intermediate_size=span(shard.intermediate), vocab_size=span(shard.vocab), head_dim=config.head_dim,
                   eos_token_ids=list(config.eos_token_ids), moe_layers=list(config.moe_layers),
                   local_experts=shard.experts if config.moe_layers else None,
                   shared_expert_intermediate_size=span(shard.shared))


Weight = torch.Tensor | BlockQuantized


def shard_state_dict(config: ModelConfig, state: dict[str, Weight], shard: RankShard) -> dict[str, Weight]:
    """``shard``'s slices of the full model's fused ``state`` (float tensors or ``BlockQuantized``), as copies."""
    d, hq, hkv, inter = config.head_dim, config.num_heads, config.num_kv_heads, config.intermediate_size
    (q0, q1), (k0, k1), (i0, i1) = shard.q_heads, shard.kv_heads, shard.intermediate
    qkv_rows = [(q0 * d, q1 * d), ((hq + k0) * d, (hq + k1) * d), ((hq + hkv + k0) * d, (hq + hkv + k1) * d)]
    (s0, s1), shared = shard.shared, config.shared_expert_intermediate_size
    out = {}
    for name, weight in state.items():
        if name.endswith("shared_expert.gate_up_proj.weight"):
            out[name] = _rows(weight, [(s0, s1), (shared + s0, shared + s1)])
        elif name.endswith("shared_expert.down_proj.weight"):
            out[name] = _columns(name, weight, (s0, s1))
        elif ".mlp.experts." in name:  # layers.{i}.mlp.experts.{e}.*: whole, on the rank that holds expert e
            if shard.experts[0] <= int(name.split(".")[4]) < shard.experts[1]:
                out[name] = weight
        elif name in ("embed_tokens.weight", "lm_head.weight"):
            out[name] = _rows(weight, [shard.vocab])
        elif name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            out[name] = _rows(weight, qkv_rows)
        elif name.endswith("o_proj.weight"):
            out[name] = _columns(name, weight, (q0 * d, q1 * d))
        elif name.endswith("gate_up_proj.weight"):
            out[name] = _rows(weight, [(i0, i1), (inter + i0, inter + i1)])
        elif name.endswith("down_proj.weight"):
            out[name] = _columns(name, weight, (i0, i1))
        else:  # the norms, a mixture of experts' router and its shared expert's gate
            out[name] = weight
    return out


def _rows(weight: Weight, ranges: list[Range]) -> Weight:
    take = lambda t: torch.cat([t[a:b] for a, b in ranges])
    return weight.map_rows(take) if isinstance(weight, BlockQuantized) else take(weight)


def _columns(name: str, weight: Weight, columns: Range) -> Weight:
    a, b = columns
    if not isinstance(weight, BlockQuantized):
        return weight[:, a:b].contiguous()
    if a % QUANT_BLOCK or b % QUANT_BLOCK:
        raise ValueError(f"{name} is kept in blocks of {QUANT_BLOCK} inputs ({weight.format}) and this rank's "
                         f"columns [{a}, {b}) cut a block; use quantization 'none' or another tensor_parallel_size")
    blocks = slice(a // QUANT_BLOCK, b // QUANT_BLOCK)
    mins = None if weight.min is None else weight.min[:, blocks].contiguous()
    return BlockQuantized(weight.format, weight.q[:, a:b].contiguous(), weight.scale[:, blocks].contiguous(), mins)


def kv_cache_blocks(config: ModelConfig, cache: CacheConfig, shards: list[RankShard]) -> int:
    """Blocks in every rank's KV pool: the same count on all (one block table serves every rank), as many as fit in
    ``cache.kv_cache_memory_bytes`` on the rank with the most KV heads (the budget is per rank), or
    ``cache.num_blocks``."""
    if cache.num_blocks:
        return cache.num_blocks
    most = max((rank_config(config, s) for s in shards), key=lambda c: c.num_kv_heads)
    return num_blocks_for_budget(most, cache.block_size, getattr(torch, cache.cache_dtype), cache.kv_cache_memory_bytes)
