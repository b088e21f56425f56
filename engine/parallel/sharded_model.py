"""``ShardedLlama``: one tensor-parallel rank's part of the model, the ordinary ``LlamaForCausalLM`` over its shard.

Every rank builds the model class from its ``rank_config`` and its slice of the weights (layout.py) and runs the same
forward; four things differ from one process's model:

- the row-parallel products (``o_proj``, ``down_proj``, a mixture of experts' layer: its rank's experts, layout.py)
  each end in an all-reduce of their output, so the residual
  stream after every layer is the full sum, replicated on every rank. It is a forward hook on the product, so the
  parameters keep the layout's names;
- the embedding is vocabulary-parallel: each rank looks up the ids in its rows, zeros the others, and the ranks sum;
- the logits are vocabulary-parallel: each rank computes its rows' logits and rank 0 gathers the full [N, V];
- the native CPU kernels run every product and the paged attention, as on one process, but the layer runs as its
  separate products (``DecoderLayer``'s PyTorch composition), never as the fused native halves or the one-call
  decode of all layers: those add the output and down products into the residual stream inside the kernel, where no
  all-reduce can come between.

``layer_done`` (the prefill pod's per-layer KV export) runs on rank 0 after each layer, as on one process: once rank
0 has passed a layer's last all-reduce, every rank has written that layer's K/V into its pool, which rank 0 maps
(sharded_kv_cache.py), so the export reads every rank's heads while later layers compute. Rank 0's model also
sends each call to the other ranks before running it (``plan_to``, a ``RankChannel``: workers.py's ``RankWorkers``),
so that they run the same step: rank 0 owns the scheduler, and the workers hold no state but their shard and their
KV cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.model.attention import AttentionMetadata
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.model.moe import MoE
from splitserve.engine.parallel.expert_dispatch import AllToAllExperts
from splitserve.engine.parallel.layout import RankShard, rank_config, shard_state_dict
from splitserve.engine.parallel.process_group import TensorParallelGroup

# What the other ranks need to rebuild a step's AttentionMetadata: its lengths, block tables, block size, one-row
# prefills and a scaled pool's open blocks, as host lists. Pickling the metadata itself (its tensors, decode group,
# masks) took ~0.3 ms to write and 0.3-1.3 ms to read here; these lists take microseconds, and AttentionMetadata.build
# ~0.1 ms.
StepPlan = tuple[list[int], list[int], list[list[int]], int, frozenset[int], list[int] | None]


def step_plan(meta: AttentionMetadata) -> StepPlan:
    return (meta.query_lens, meta.seq_lens, meta.block_tables.tolist(), meta.block_size, meta.one_row_prefills,
            meta.open_blocks)


def metadata_from_plan(plan: StepPlan, device: torch.device | str) -> AttentionMetadata:
    """The step's metadata as rank 0 built it (``build`` pads the tables as they came: the same tensors)."""
    query_lens, seq_lens, block_tables, block_size, one_row_prefills, open_blocks = plan
    return AttentionMetadata.build(query_lens, seq_lens, block_tables, block_size, device, one_row_prefills,
                                   open_blocks=open_blocks)


class RankChannel(Protocol):
    """Rank 0's way to the other ranks (workers.py's ``RankWorkers``), as its model uses it."""

    def send(self, method: str, *args) -> None:
        """Every other rank runs ``method(*args)`` on its shard, as rank 0 is about to."""

    def failures_named(self) -> AbstractContextManager:
        """A collective that failed because a rank is gone fails naming the rank."""


class ShardedLlama(LlamaForCausalLM):
    """Built by ``LlamaForCausalLM.from_state_dict`` from a rank's config and shard, then ``shard_over`` its group."""

    group: TensorParallelGroup
    shard: RankShard
    vocab_ranges: list[tuple[int, int]]
    plan_to: RankChannel | None = None  # rank 0's handle on the other ranks; None on them
    moe_dispatch: str = "all_reduce"  # EngineConfig.moe_dispatch

    @classmethod
    def for_rank(cls, config: EngineConfig, model_config: ModelConfig, state_dict: dict, shard: RankShard
                 ) -> ShardedLlama:
        """``shard``'s rank's model from the full model's ``state_dict``, its products on the same path as one
        process's (native kernels, weight formats, int8 activations); prefill computes in float32."""
        model = cls.from_state_dict(rank_config(model_config, shard), shard_state_dict(model_config, state_dict, shard),
                                    getattr(torch, config.dtype), config.device, config.cpu_kernels,
                                    config.int8_activations)
        model.moe_dispatch = config.moe_dispatch
        return model

    def shard_over(self, group: TensorParallelGroup, shards: list[RankShard]) -> ShardedLlama:
        self.group, self.shard = group, shards[group.rank]
        self.vocab_ranges = [s.vocab for s in shards]
        dispatch = AllToAllExperts(group, shards) if self.moe_dispatch == "all_to_all" else None
        for layer in self.layers:
            # A mixture of experts' output is its rank's experts' share (moe.py): summed as a row-parallel product;
            # or, sent to its experts' ranks (expert_dispatch.py), the whole output already.
            products = [layer.attn.o_proj]
            if not isinstance(layer.mlp, MoE):
                products.append(layer.mlp.down_proj)
            elif dispatch is None:
                products.append(layer.mlp)
            else:
                layer.mlp.dispatch = dispatch
            for product in products:
                product.register_forward_hook(self._sum_over_ranks)
            layer.kernels = None  # the fused native halves would add the partial products before the sum
        return self

    def _sum_over_ranks(self, _module, _inputs, output: torch.Tensor) -> None:
        self.group.all_reduce(output)

    def _decodes_natively(self, kv_cache: PagedKVCache, meta: AttentionMetadata) -> bool:
        return False  # one native call for all layers leaves no place for the all-reduces

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                attn_metadata: AttentionMetadata, layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        if self.plan_to is not None:
            self.plan_to.send("forward", input_ids.tolist(), positions.tolist(), step_plan(attn_metadata))
        with self._failures_named():
            return super().forward(input_ids, positions, kv_cache, attn_metadata, layer_done)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: input_ids [T] (the full vocabulary's) -> [T, H], summed over the ranks."""
        start, end = self.shard.vocab
        mine = (input_ids >= start) & (input_ids < end)
        x = super().embed(torch.where(mine, input_ids - start, 0)).masked_fill_(~mine[:, None], 0.0)
        self.group.all_reduce(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, H] -> the full logits [N, V] float32 on rank 0; None on the other ranks."""
        if self.plan_to is not None:
            self.plan_to.send("compute_logits", hidden)
        with self._failures_named():
            parts = self.group.gather(super().compute_logits(hidden), [b - a for a, b in self.vocab_ranges])
        return None if parts is None else torch.cat(parts, dim=1)

    def time_all_reduce(self, numel: int, repeats: int, transport: str = "auto") -> list[float]:
        """Seconds of each of ``repeats`` all-reduces of ``numel`` float32 over the ranks, as this rank saw them, on
        the group's transport (``transport`` "gloo": on gloo): the communication model the benchmark fits
        (bench/tp.py). Not counted in ``group.counts``."""
        if self.plan_to is not None:
            self.plan_to.send("time_all_reduce", numel, repeats, transport)
        payload, seconds = torch.zeros(numel), []
        with self._failures_named():
            for _ in range(repeats):
                started = time.perf_counter()
                self.group.all_reduce(payload, counted=False, transport=transport)
                seconds.append(time.perf_counter() - started)
        return seconds

    def time_all_to_all(self, numel: int, repeats: int) -> list[float]:
        """Seconds of each of ``repeats`` all-to-alls of ``numel`` float32 (each rank sends numel / ranks to each, as
        expert_dispatch.py sends rows: the counts first, then the rows), as this rank saw them (bench/tp.py's
        comparison for expert parallelism; counted in ``group.counts``, unlike ``time_all_reduce``)."""
        if self.plan_to is not None:
            self.plan_to.send("time_all_to_all", numel, repeats)
        payload, seconds = torch.zeros(numel), []
        with self._failures_named():
            for _ in range(repeats):
                started = time.perf_counter()
                self.group.all_to_all_rows(payload, [numel // self.group.size] * self.group.size)
                seconds.append(time.perf_counter() - started)
        return seconds

    def _failures_named(self):
        return self.plan_to.failures_named() if self.plan_to is not None else nullcontext()
