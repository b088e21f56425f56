"""Pipeline parallelism inside one engine (``EngineConfig.pipeline_parallel_size``): the model's layers split over
ranks that are processes of their own, a step's rows cut into micro-batches that follow each other through them.

Rank r holds layers ``even_ranges(num_layers, N)[r]`` (``stage_state_dict``); every rank also keeps the embedding,
the final norm and the LM head, which only rank 0 runs (a first cut: they are small beside the layers of the models
this runs). The KV pool is one shared file of every layer (sharded_kv_cache.py's ``create_pools`` and ``map_pool``
over the whole model) that every rank maps: each rank's layers write their own layers' K/V there, and rank 0 reads
and writes any layer for the KV transfer as a one-process engine does, with no change to the wire.

A step (``PipelinedLlama.forward`` on rank 0, ``run_stage`` on the others):

    rank 0      sends the step's positions and micro-batches to the ranks (workers.py's stdin messages); embeds every
                row; for each micro-batch runs its layers and sends the rows on to rank 1 (gloo, asynchronously), then
                goes on with the next micro-batch while rank 1 runs this one
    rank r      for each micro-batch: receives the rows from rank r - 1, runs its layers, sends them on (the last
                rank: back to rank 0)
    rank 0      receives every micro-batch's rows from the last rank, applies the final norm; the logits follow on
                rank 0 alone

A micro-batch is a run of the step's rows (``micro_batches``): whole decode rows, and prompts cut inside where a
boundary falls, each piece a chunked prefill of its own (its query rows over the context before it), so that one
long prompt pipelines too: piece k + 1 of a prompt attends to piece k's K/V, which the same rank wrote just before.
Every product and attention is the one-process model's own, on the same rows in the same order; what differs is only
where a prompt's attention is cut into chunks, which reads the earlier chunk's K/V from the cache (in the cache's
dtype: float32 caches give TP 1's results to rounding). The prefill pod's per-layer export runs after the step
(layer by layer as each rank finishes would need a message back per layer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from itertools import accumulate

import torch

from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.kv_cache import PagedKVCache, num_blocks_for_budget
from splitserve.engine.model.attention import AttentionMetadata
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.parallel.layout import Range, even_ranges
from splitserve.engine.parallel.process_group import TensorParallelGroup
from splitserve.engine.parallel.sharded_kv_cache import create_pool, map_pool
from splitserve.engine.parallel.sharded_model import StepPlan, metadata_from_plan
from splitserve.engine.parallel.workers import RankLaunch

logger = logging.getLogger(__name__)

# One micro-batch: the step's rows [start, end) and the plan of its metadata (sharded_model.py's StepPlan).
MicroBatch = tuple[Range, StepPlan]
MICRO_BATCHES_PER_RANK = 2  # micro-batches a step is cut into, per rank: enough for every rank to have work


def stage_state_dict(config: ModelConfig, state: dict, layers: Range) -> tuple[ModelConfig, dict]:
    """The config and weights of the stage holding ``layers`` [start, end): those layers renumbered from 0, with the
    embedding, final norm and LM head."""
    start, end = layers
    out = {}
    for name, weight in state.items():
        if not name.startswith("layers."):
            out[name] = weight
            continue
        _, index, rest = name.split(".", 2)
        if start <= int(index) < end:
            out[f"layers.{int(index) - start}.{rest}"] = weight
    moe_layers = [i - start for i in config.moe_layers if start <= i < end]
    return replace(config, num_layers=end - start, eos_token_ids=list(config.eos_token_ids),
                   layer_windows=config.layer_windows[start:end], moe_layers=moe_layers), out


def micro_batches(meta: AttentionMetadata, count: int) -> list[MicroBatch]:
    """The step's rows cut into up to ``count`` runs of about equal rows; a prompt's rows may be cut (each piece a
    chunk over the context before it), a decode row is never split from its sequence's other rows."""
    total = sum(meta.query_lens)
    bounds = sorted({round(total * k / count) for k in range(1, count)} - {0, total})
    starts = [0, *accumulate(meta.query_lens)]
    tables = meta.block_tables.tolist()
    pieces: list[tuple[int, int, int]] = []  # (sequence, first row, end row) within the sequence's rows
    for i, n in enumerate(meta.query_lens):
        prefill = n > 1 or i in meta.one_row_prefills
        cuts = [b - starts[i] for b in bounds if starts[i] < b < starts[i] + n] if prefill else []
        pieces += [(i, a, b) for a, b in zip([0, *cuts], [*cuts, n])]
    out: list[MicroBatch] = []
    group: list[tuple[int, int, int]] = []
    for piece in pieces:
        group.append(piece)
        row_end = starts[piece[0]] + piece[2]
        if row_end in bounds or piece is pieces[-1]:
            out.append(_micro_batch(meta, group, starts, tables))
            group = []
    return out


def _micro_batch(meta: AttentionMetadata, group: list[tuple[int, int, int]], starts: list[int],
                 tables: list[list[int]]) -> MicroBatch:
    query_lens, seq_lens, block_tables, one_row = [], [], [], set()
    for j, (i, a, b) in enumerate(group):
        context = meta.seq_lens[i] - meta.query_lens[i]
        query_lens.append(b - a)
        seq_lens.append(context + b)
        block_tables.append(tables[i])
        if b - a == 1 and (meta.query_lens[i] > 1 or i in meta.one_row_prefills):
            one_row.add(j)  # one prompt row: still a prefill, as the whole prompt was
    first, last = group[0], group[-1]
    rows = (starts[first[0]] + first[1], starts[last[0]] + last[2])
    # A scaled pool's open blocks: a prompt cut here reads its earlier rows' keys from them, as a later chunk does.
    open_blocks = None if meta.open_blocks is None else [meta.open_blocks[i] for i, _, _ in group]
    return rows, (query_lens, seq_lens, block_tables, meta.block_size, frozenset(one_row), open_blocks)


class PipelineStage(LlamaForCausalLM):
    """One rank's layers (``first_layer`` on), built by ``from_state_dict`` from ``stage_state_dict``'s output."""

    first_layer: int = 0
    group: TensorParallelGroup

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                   meta: AttentionMetadata) -> torch.Tensor:
        """This stage's layers over rows ``x`` [T, H], their K/V at the model's layer indices in ``kv_cache``."""
        rotary = self.rotary.for_step(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, rotary, kv_cache.k_blocks[self.first_layer + i], kv_cache.v_blocks[self.first_layer + i],
                      meta)
        return x

    def run_stage(self, positions: torch.Tensor, plan: list[MicroBatch], kv_cache: PagedKVCache) -> None:
        """A rank other than 0: each micro-batch received from the rank before, run, sent to the next (the last
        rank: to rank 0)."""
        rank, size = self.group.rank, self.group.size
        hidden = self.norm.weight.shape[0]
        sends = []
        for (start, end), step in plan:
            rows = torch.empty(end - start, hidden, dtype=self.norm.weight.dtype)
            self.group.recv(rows, rank - 1)
            rows = self.run_layers(rows, positions[start:end], kv_cache, metadata_from_plan(step, rows.device))
            sends.append((rows, self.group.send(rows, (rank + 1) % size)))
        for _, sending in sends:
            sending.wait()


class PipelinedLlama(PipelineStage):
    """Rank 0's model: the embedding, its layers, the final norm and the LM head; ``plan_to``: the other ranks."""

    plan_to = None  # RankWorkers, set by start_pipeline_parallel
    num_layers_total: int = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: PagedKVCache,
                attn_metadata: AttentionMetadata, layer_done: Callable[[int], None] | None = None) -> torch.Tensor:
        plan = micro_batches(attn_metadata, MICRO_BATCHES_PER_RANK * self.group.size)
        self.plan_to.send("pipeline", positions.tolist(), plan)
        with self.plan_to.failures_named():
            x = self.embed(input_ids)
            sends = []
            for (start, end), step in plan:
                rows = self.run_layers(x[start:end].contiguous(), positions[start:end], kv_cache,
                                       metadata_from_plan(step, x.device))
                sends.append((rows, self.group.send(rows, 1)))
            out = torch.empty_like(x)
            for (start, end), _ in plan:
                rows = torch.empty(end - start, x.shape[1], dtype=x.dtype)
                self.group.recv(rows, self.group.size - 1)
                out[start:end] = rows
            for _, sending in sends:
                sending.wait()
        for layer in range(self.num_layers_total if layer_done is not None else 0):
            layer_done(layer)
        return self.norm(out)


def stage_model(cls: type[PipelineStage], config: EngineConfig, model_config: ModelConfig, state_dict: dict,
                layers: Range) -> PipelineStage:
    """Rank's stage model over ``layers``; the products on one process's path (native kernels, weight formats)."""
    stage_config, stage_state = stage_state_dict(model_config, state_dict, layers)
    model = cls.from_state_dict(stage_config, stage_state, getattr(torch, config.dtype), config.device,
                                config.cpu_kernels, config.int8_activations)
    model.first_layer = layers[0]
    return model


def layer_ranges(config: ModelConfig, size: int) -> list[Range]:
    if not isinstance(size, int) or size < 1 or size > config.num_layers:
        raise ValueError(f"pipeline_parallel_size must be an integer in [1, {config.num_layers}] (the model's "
                         f"layers), got {size!r}")
    return even_ranges(config.num_layers, size)


def start_pipeline_parallel(config: EngineConfig, model_config: ModelConfig,
                            state_dict: dict) -> tuple[PipelinedLlama, PagedKVCache]:
    """Rank 0's model and the shared KV pool, with ranks 1..N-1 started and joined (workers.py's ``RankLaunch``, as
    tensor parallelism starts, over layers instead of heads)."""
    size = config.pipeline_parallel_size
    layers = layer_ranges(model_config, size)
    cache, dtype = config.cache, getattr(torch, config.cache.cache_dtype)
    num_blocks = cache.num_blocks or num_blocks_for_budget(model_config, cache.block_size, dtype,
                                                           cache.kv_cache_memory_bytes)
    launch = RankLaunch(config, size, "pipeline_parallel_size")
    fd = create_pool(model_config, num_blocks, cache.block_size, dtype)
    kv_cache = launch.start_workers(num_blocks, [fd], [fd] * size,
                                    lambda: map_pool(fd, model_config, num_blocks, cache.block_size, dtype))
    model = launch.join(lambda: stage_model(PipelinedLlama, config, model_config, state_dict, layers[0]),
                        lambda model, group: setattr(model, "group", group), "during a transfer")
    model.num_layers_total = model_config.num_layers
    logger.info("pipeline parallel: %d ranks on cores %s, layers %s", size, launch.shares, layers)
    return model, kv_cache
