"""The ``draft`` method's proposer model: a smaller model of the same tokenizer, run on the same engine with its own
paged KV cache.

Its cache mirrors the target's block layout (the same number of blocks of the same size), so a sequence's block
table addresses both: the draft needs no block manager of its own. A sequence's draft KV is valid up to
``DraftState.draft_computed`` tokens; before proposing, the draft catches up over the tokens after that (its whole
prompt the first time, then the tokens accepted since), and each proposal is k greedy draft steps: one row per
sequence, feeding back the token it just proposed. Greedy proposals are point masses, which the target's
verification (engine/speculative/proposer.py) accepts exactly. After verification, the draft KV of accepted drafts is
the KV of the tokens now in the sequence; the slots of rejected ones are written over by the next catch-up.

A random-weight draft (``tiny-random``) is built with ``SpeculativeConfig.draft_seed`` (the engine's seed when
None): the same seed as a random target makes the draft that target, a different one another model of the same
vocabulary.
"""

from __future__ import annotations

import torch

from splitserve.engine.config import EngineConfig, ModelConfig
from splitserve.engine.kv_cache import PagedKVCache
from splitserve.engine.model.attention import AttentionMetadata
from splitserve.engine.model.llama import LlamaForCausalLM
from splitserve.engine.sequence import Sequence
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.engine.weights.model_files import load_model_files


class DraftModel:
    def __init__(self, config: EngineConfig, target: ModelConfig, target_tokenizer: Tokenizer, num_blocks: int):
        speculative = config.speculative
        seed = config.seed if speculative.draft_seed is None else speculative.draft_seed
        loaded = load_model_files(speculative.model, seed=seed)
        _check_same_vocabulary(loaded.tokenizer, target_tokenizer, loaded.config, target)
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.model = LlamaForCausalLM.from_state_dict(loaded.config, loaded.state_dict, getattr(torch, config.dtype),
                                                      self.device, config.cpu_kernels)
        self.kv_cache = PagedKVCache(loaded.config, num_blocks, self.block_size, config.cache.cache_dtype, self.device)
        self.config = loaded.config

    def parameter_ratio(self, target: torch.nn.Module) -> float:
        """The draft's parameters over the target's: about what one draft step costs next to one target step."""
        return _num_parameters(self.model) / _num_parameters(target)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], lengths: list[int]) -> None:
        """Set ``draft_token_ids`` of each of ``seqs`` to its ``lengths[i]`` greedy draft tokens; every sequence's
        block table must cover its tokens and the drafts' positions."""
        if not seqs:
            return
        # The catch-up: each sequence's tokens from draft_computed through its last one (all of them after a
        # preemption, which freed its blocks); the last row predicts d0.
        starts = [seq.speculation.draft_computed if seq.speculation.draft_preemptions == seq.num_preemptions else 0
                  for seq in seqs]
        rows = [(seq, start, seq.num_tokens - start) for seq, start in zip(seqs, starts)]
        tokens = self._step(rows, [seq.token_slice(start, seq.num_tokens) for seq, start in zip(seqs, starts)])
        drafts = [[token] for token in tokens]
        for seq in seqs:
            seq.speculation.draft_computed, seq.speculation.draft_preemptions = seq.num_tokens, seq.num_preemptions
        for j in range(1, max(lengths)):
            going = [i for i, k in enumerate(lengths) if k > j]
            rows = [(seqs[i], seqs[i].num_tokens - 1 + j, 1) for i in going]
            for i, token in zip(going, self._step(rows, [[drafts[i][-1]] for i in going])):
                drafts[i].append(token)
        for seq, draft, k in zip(seqs, drafts, lengths):
            seq.draft_token_ids = draft[:k]

    def _step(self, rows: list[tuple[Sequence, int, int]], inputs: list[list[int]]) -> list[int]:
        """One forward pass of the draft: rows (seq, first position, tokens) with their input tokens; the argmax
        token after each row's last position."""
        input_ids = [t for tokens in inputs for t in tokens]
        positions = [p for _, start, n in rows for p in range(start, start + n)]
        meta = AttentionMetadata.build([n for _, _, n in rows], [start + n for _, start, n in rows],
                                       [seq.block_table for seq, _, _ in rows], self.block_size, self.device)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        hidden = self.model(as_tensor(input_ids), as_tensor(positions), self.kv_cache, meta)  # [T, H]
        last_rows = meta.query_start_loc[1:] - 1
        return self.model.compute_logits(hidden[last_rows]).argmax(dim=-1).tolist()


def _num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _check_same_vocabulary(draft: Tokenizer, target: Tokenizer, draft_config: ModelConfig,
                           target_config: ModelConfig) -> None:
    """A draft proposes token ids: they must mean what they mean to the target."""
    if draft_config.vocab_size != target_config.vocab_size or draft.vocab_size != target.vocab_size or any(
            draft.id_to_token(i) != target.id_to_token(i) for i in range(target.vocab_size)):
        raise ValueError(f"the draft model {draft_config.name!r} does not share the target {target_config.name!r}'s "
                         "tokenizer (vocabularies differ)")
