"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, and samples.

Owns the model weights, the ``PagedKVCache`` and the ``Sampler`` of one engine. The scheduler says which
sequences run and how many new tokens each contributes; the runner flattens them into one varlen batch
(``input_ids``/``positions``: [T]), maps every new token to its cache slot through the sequence's block table,
and samples one token for each sequence whose scheduled tokens reach the end of its known tokens.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig, ModelConfig
from engine.kv_cache import PagedKVCache
from engine.model import LlamaForCausalLM
from engine.sampler import Sampler, SamplingRow
from engine.scheduler import SchedulerOutput

SampledTokens = dict[str, tuple[int, dict[int, float] | None]]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, state_dict: dict[str, torch.Tensor]):
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.block_size = config.cache.block_size
        self.model = LlamaForCausalLM.from_state_dict(
            model_config, state_dict, self.dtype, self.device, config.cpu_kernels
        )
        self.kv_cache = PagedKVCache.from_config(model_config, config.cache, self.device)
        self.sampler = Sampler(model_config.vocab_size, model_config.eos_token_ids, self.device, config.seed)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, layer_done: Callable[[int], None] | None = None) -> SampledTokens:
        """Run one step; returns {request_id: (token_id, logprobs)} for the sequences that sample."""
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, layer_done)  # [T, hidden]
        sampling = [i for i, s in enumerate(batch.scheduled) if s.samples]
        if not sampling:
            return {}
        # The last new token of each sampling sequence is the one whose logits predict the next token.
        last_rows = meta.query_start_loc[1:][sampling] - 1
        logits = self.model.compute_logits(hidden[last_rows])  # [N, vocab] float32
        rows = [_sampling_row(batch.scheduled[i].seq) for i in sampling]
        out = self.sampler.sample(logits, rows)
        return {
            batch.scheduled[i].seq.request_id: (token, lp)
            for i, token, lp in zip(sampling, out.token_ids, out.logprobs)
        }

    def _prepare(self, batch: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        tokens: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        for s in batch.scheduled:
            end = s.start + s.num_new_tokens
            tokens.extend(s.seq.token_slice(s.start, end))
            positions.extend(range(s.start, end))
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
        block_tables = [s.seq.block_table for s in batch.scheduled]
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, self.block_size, self.device)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(tokens), as_tensor(positions), meta


def _sampling_row(seq) -> SamplingRow:
    return SamplingRow(seq.sampling_params, seq.prompt_token_ids, seq.output_token_ids)
