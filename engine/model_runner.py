"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, and samples.

Owns the model weights, the ``PagedKVCache`` and the ``Sampler`` of one engine. The scheduler says which
sequences run and how many new tokens each contributes; the runner flattens them into one varlen batch
(``input_ids``/``positions``: [T]), maps every new token to its cache slot through the sequence's block table,
and samples one token for each sequence whose scheduled tokens reach the end of its known tokens. A sequence that
asked for prompt logprobs gets them from the rows of its prompt positions (``Sequence.prompt_logprobs``).

Every output position runs as a decode row, attending to keys 0..its position through the sequence's block
table: the decode step sequential decoding runs there, in the same kernels, so the same bits. A prefill's rows are
summed in another order than a decode step's (GEMM tiles and one softmax against flash-decoding's chunks), so this
is what makes recomputed outputs exact: a request preempted and prefilled again, or migrated with its
``resume_token_ids``, gets the very KV the undisturbed run had, and continues as it would have. A sequence
verifying k draft tokens (engine/speculative/proposer.py) likewise becomes k + 1 decode rows; every row samples, and
``accept_drafts`` keeps the rows up to the first disagreement.

With ``tensor_parallel_size`` > 1 the model is rank 0's shard (engine/parallel/): it runs each call on every rank,
returns the full logits, and the KV cache holds rank 0's KV heads.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Callable

import torch

from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.kv_formats import open_keys
from splitserve.engine.kv_groups import window_group_blocks
from splitserve.engine.model.attention import AttentionMetadata
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.parallel.pipeline import start_pipeline_parallel
from splitserve.engine.parallel.workers import start_tensor_parallel
from splitserve.engine.sampling.sampler import Sampler, SamplingRow, prompt_logprobs
from splitserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from splitserve.engine.speculative.proposer import accept_drafts
from splitserve.engine.structured_output.masks import GrammarMasks

# Prompt positions whose logits are computed at a time for prompt logprobs: [64, V] float32 is 12 MiB for SmolLM2.
PROMPT_LOGPROB_ROWS = 64

# request id -> the step's tokens for it, each with its logprobs (or None): one, or 1 + accepted drafts.
SampledTokens = dict[str, list[tuple[int, dict[int, float] | None]]]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, state_dict: dict[str, torch.Tensor],
                 grammar_masks: GrammarMasks | None = None):
        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.block_size = config.cache.block_size
        if config.tensor_parallel_size > 1:  # this process is rank 0: it holds shard 0 and drives the other ranks
            self.model, self.kv_cache = start_tensor_parallel(config, model_config, state_dict)
        elif config.pipeline_parallel_size > 1:  # rank 0 again: the first layers, the embedding and the LM head
            self.model, self.kv_cache = start_pipeline_parallel(config, model_config, state_dict)
        else:
            self.model = LlamaForCausalLM.from_state_dict(
                model_config, state_dict, self.dtype, self.device, config.cpu_kernels, config.int8_activations,
                config.prefill_compute_dtype, config.prefill_only,
            )
            self.kv_cache = PagedKVCache.from_config(model_config, config.cache, self.device,
                                                     window_group_blocks(config, model_config))
        self.sampler = Sampler(model_config.vocab_size, model_config.eos_token_ids, self.device, config.seed)
        self.grammar_masks = grammar_masks  # structured outputs' masks (None: no request may be guided)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput, layer_done: Callable[[int], None] | None = None) -> SampledTokens:
        """Run one step; returns {request_id: [(token_id, logprobs)]} for the sequences that sample."""
        input_ids, positions, meta = self._prepare(batch)
        sampling = [s for s in batch.scheduled if s.samples]
        # Structured outputs: their masks are computed on other threads while the model runs.
        pending_masks = self.grammar_masks.start([s.seq for s in sampling]) if self.grammar_masks else None
        hidden = self.model(input_ids, positions, self.kv_cache, meta, layer_done)  # [T, hidden]
        self._record_prompt_logprobs(batch, hidden)
        if not sampling:
            return {}
        # The last 1 + k rows of each sampling sequence (k drafts) predict its next tokens; the step's rows are its
        # tokens, in batch order.
        ends = list(accumulate(s.num_new_tokens for s in batch.scheduled))
        # A first token of n > 1 samples: the prompt's last row once per sample.
        rows = [row for s, end in zip(batch.scheduled, ends) if s.samples
                for row in [*range(end - 1 - len(s.draft_token_ids), end)] + [end - 1] * (_num_samples(s) - 1)]
        logits = self.model.compute_logits(hidden[rows])  # [N, vocab] float32
        allowed = pending_masks.result() if pending_masks is not None else {}
        out = self.sampler.sample(logits, [row for s in sampling
                                           for row in _sampling_rows(s, allowed.get(s.seq.request_id))])
        sampled: SampledTokens = {}
        first = 0
        for s in sampling:
            tokens, logprobs = out.token_ids[first:], out.logprobs[first:]
            emitted = accept_drafts(tokens, s.draft_token_ids)
            sampled[s.seq.request_id] = list(zip(tokens[:emitted], logprobs[:emitted]))
            samples = _num_samples(s)
            if samples > 1:
                s.seq.sample_first_tokens = list(zip(tokens[1:samples], logprobs[1:samples]))
            first += len(s.draft_token_ids) + samples
        return sampled

    def _record_prompt_logprobs(self, batch: SchedulerOutput, hidden: torch.Tensor) -> None:
        """Append to ``seq.prompt_logprobs`` the entries of the prompt positions this step computed: the row of
        position p predicts prompt token p + 1. Positions whose entries a sequence already has (recomputed after a
        preemption) are skipped."""
        first_row = 0  # the scheduled sequence's first row in hidden
        for s in batch.scheduled:
            seq = s.seq
            if seq.needs_prompt_logprobs:
                end = min(s.start + s.num_new_tokens, seq.num_prompt_tokens - 1)
                for lo in range(max(s.start, len(seq.prompt_logprobs)), end, PROMPT_LOGPROB_ROWS):
                    hi = min(lo + PROMPT_LOGPROB_ROWS, end)
                    logits = self.model.compute_logits(hidden[first_row + lo - s.start:first_row + hi - s.start])
                    targets = torch.tensor(seq.prompt_token_ids[lo + 1:hi + 1], dtype=torch.long, device=self.device)
                    seq.prompt_logprobs.extend(prompt_logprobs(logits.log_softmax(dim=-1), targets,
                                                               seq.sampling_params.prompt_logprobs))
            first_row += s.num_new_tokens

    def _prepare(self, batch: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        tokens: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        window_tables: list[list[int]] = []  # the window pool's (kv_cache.window_layers), where the cache has one
        open_blocks: list[int] = []  # each row's sequence's open blocks (a scaled pool: kv_formats/open_keys.py)
        window_open_blocks: list[int] = []
        one_row_prefills: set[int] = set()
        for s in batch.scheduled:
            end = s.start + s.num_new_tokens
            tokens.extend(s.seq.token_slice(s.start, end - len(s.draft_token_ids)))
            tokens.extend(s.draft_token_ids)
            positions.extend(range(s.start, end))
            # Output positions (verified drafts, or outputs recomputed after a preemption or a migration) run as
            # one decode row each, attending up to itself: the arithmetic that computed them the first time.
            outputs_from = min(end, max(s.start, s.seq.num_prompt_tokens))
            if outputs_from > s.start:  # prompt positions: one prefill segment
                if outputs_from - s.start == 1:
                    one_row_prefills.add(len(query_lens))
                query_lens.append(outputs_from - s.start)
                seq_lens.append(outputs_from)
                block_tables.append(s.seq.block_table)
                window_tables.append(s.seq.window_block_table)
            query_lens.extend([1] * (end - outputs_from))
            seq_lens.extend(range(outputs_from + 1, end + 1))
            block_tables.extend([s.seq.block_table] * (end - outputs_from))
            window_tables.extend([s.seq.window_block_table] * (end - outputs_from))
            open_blocks.extend([s.seq.open_block] * (len(query_lens) - len(open_blocks)))
            window_open_blocks.extend([s.seq.window_open_block] * (len(query_lens) - len(window_open_blocks)))
        opens = open_keys.used_by(self.kv_cache.dtype)
        windowed = bool(self.kv_cache.window_layers)
        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, self.block_size, self.device,
                                       frozenset(one_row_prefills), window_tables if windowed else None,
                                       open_blocks if opens else None,
                                       window_open_blocks if opens and windowed else None)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(tokens), as_tensor(positions), meta


def _num_samples(s: ScheduledSeq) -> int:
    """Rows a sampling sequence draws at the prompt's last position: ``n`` for the first token of n > 1 samples."""
    seq = s.seq
    return seq.sampling_params.n if seq.num_output_tokens == 0 and not s.draft_token_ids else 1


def _sampling_rows(s: ScheduledSeq, allowed: torch.Tensor | None = None) -> list[SamplingRow]:
    """The sampling row of each verified position: row j samples as if drafts 0..j-1 were already output (penalties,
    min_tokens and the seeded draw's position see them); then, for the first token of n > 1 samples, one row per
    further sample, seeded seed + i (``SamplingParams.for_sample``). ``allowed``: the grammar's mask of a guided
    sequence (which never has drafts: the engine does not speculate for it)."""
    seq = s.seq
    outputs = seq.output_token_ids  # as it is for row 0 (every row when not speculating): no copy per step
    rows = [SamplingRow(seq.sampling_params, seq.prompt_token_ids, outputs + s.draft_token_ids[:j] if j else outputs,
                        allowed if j == 0 else None)
            for j in range(len(s.draft_token_ids) + 1)]
    return rows + [SamplingRow(seq.sampling_params.for_sample(i), seq.prompt_token_ids, outputs, allowed)
                   for i in range(1, _num_samples(s))]
