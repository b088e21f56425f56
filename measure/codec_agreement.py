"""A KV codec's round trip in place in an engine's paged cache, and the greedy agreement it leaves: what
``bench codecs`` measures per codec, what its ``--through-up`` run compares the served path with, and what
``scripts/codec_diagnosis.py`` dissects.

The path, as a prompt takes it across the pods: ``reference_run`` prefills the prompts losslessly (the prefill pod)
and continues them greedily, keeping each prompt's KV and first token (``PromptKV``); ``greedy_outputs`` then
replays them as a decode pod does: blocks reserved, the prompt's KV written after the codec's round trip
(``write_round_trip``, which ``KVTally`` sizes), the sequence admitted with its first token and decoded;
``agreement`` compares the two continuations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine import LLM, LLMEngine, SamplingParams
from splitserve.engine.config import CacheConfig
from splitserve.engine.kv_cache import KV_KINDS
from splitserve.engine.sequence import Sequence
from splitserve.kvtransfer.codecs import EncodedKV, KVCodec
from splitserve.measure.codec_texts import LONG_PROMPT_CAP

BLOCK_SIZE = CacheConfig.block_size
AGREEMENT_GROUP = 10  # prompts decoded together (and their lossless KV held at once)
BF16_BYTES = 2


def load_model(model: str, cache_dtype: str, groups: list[list[list[int]]], max_tokens: int,
               longest_other: int = 0) -> LLM:
    """The engine the agreement runs on: room for the largest group of prompts with their ``max_tokens`` outputs
    (or for one sequence of ``longest_other`` tokens, if more), no more: a float32 cache of 40 long prompts is
    gigabytes. A group's prompts prefill in steps of at most max_num_batched_tokens, and the cache holds them with
    their outputs: no preemption."""
    blocks = max(max(_cache_blocks(group, max_tokens) for group in groups), -(-longest_other // BLOCK_SIZE))
    return LLM(model=model, enable_prefix_caching=False, max_num_seqs=max(map(len, groups)), block_size=BLOCK_SIZE,
               cache_dtype=cache_dtype, num_blocks=blocks, long_prefill_token_threshold=LONG_PROMPT_CAP,
               max_num_batched_tokens=4096)


def _cache_blocks(prompts: list[list[int]], max_tokens: int) -> int:
    return sum(-(-(len(prompt) + max_tokens) // BLOCK_SIZE) for prompt in prompts)


@dataclass
class KVTally:
    """What a codec did to the KV it round-tripped."""

    elements: int = 0
    encoded_bytes: int = 0  # payload + scales
    max_abs_error: float = 0.0

    def add(self, original: torch.Tensor, decoded: torch.Tensor, encoded: EncodedKV) -> None:
        self.add_size(original, encoded)
        self.max_abs_error = max(self.max_abs_error, (decoded.float() - original.float()).abs().max().item())

    def add_size(self, original: torch.Tensor, encoded: EncodedKV) -> None:
        self.elements += original.numel()
        self.encoded_bytes += encoded.nbytes

    @property
    def ratio_to_bf16(self) -> float:
        return BF16_BYTES * self.elements / self.encoded_bytes


@dataclass
class PromptKV:
    """A prompt prefilled once, losslessly: its KV and first token, which every codec's run starts from."""

    tokens: list[int]
    kv: torch.Tensor  # [layers, 2 (K, V), T, H, D] in the cache dtype, on the cache's device
    first_token: int = -1  # sampled from the lossless logits, as on a prefill pod; -1 for perplexity contexts


def read_prompt_kv(engine: LLMEngine, seq: Sequence, num_tokens: int) -> torch.Tensor:
    """The KV of ``seq``'s first ``num_tokens`` tokens, every layer, K and V: [layers, 2, T, H, D] (copies)."""
    cache = engine.runner.kv_cache
    slots = cache.slots(seq.block_table, 0, num_tokens)
    return torch.stack([torch.stack([cache.read(layer, kind, slots) for kind in KV_KINDS])
                        for layer in range(cache.num_layers)])


def write_round_trip(engine: LLMEngine, seq: Sequence, kv: torch.Tensor, codec: KVCodec, tally: KVTally,
                     sized: dict[str, tuple[KVCodec, KVTally]]) -> None:
    """Write ``kv`` ([layers, 2, T, H, D]) after its codec round trip into ``seq``'s first T slots, as a decode pod
    stores a pushed prompt; the ``sized`` codecs (``codec``+zstd) encode the same KV too, for their sizes alone."""
    cache = engine.runner.kv_cache
    slots = cache.slots(seq.block_table, 0, kv.shape[2])
    for layer in range(cache.num_layers):
        for index, kind in enumerate(KV_KINDS):
            original = kv[layer, index]  # [T, H, D]
            encoded = codec.encode(original, kind)
            decoded = codec.decode(encoded, original.device)
            tally.add(original, decoded, encoded)
            for other, other_tally in sized.values():
                other_tally.add_size(original, other.encode(original, kind))
            cache.write(layer, kind, slots, decoded)




# ---- greedy agreement --------------------------------------------------------------------------------------------

def reference_run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]],
                                                                                          list[PromptKV]]:
    """The lossless greedy continuations of ``prompts``, batched, and each prompt's KV and first token, taken
    right after its prefill step."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(f"reference-{i}", prompt, params) for i, prompt in enumerate(prompts)]
    prefilled: dict[int, PromptKV] = {}
    while engine.has_unfinished_requests():
        engine.step()
        for i, seq in enumerate(seqs):
            if i not in prefilled and seq.num_computed_tokens >= seq.num_prompt_tokens and not seq.is_finished:
                kv = read_prompt_kv(engine, seq, seq.num_prompt_tokens)
                prefilled[i] = PromptKV(seq.prompt_token_ids, kv, seq.output_token_ids[0])
    _check_no_preemption(seqs)
    return [seq.output_token_ids for seq in seqs], [prefilled[i] for i in range(len(seqs))]


def greedy_outputs(engine: LLMEngine, prompts: list[PromptKV], max_tokens: int, codec: KVCodec, tally: KVTally,
                   sized: dict[str, tuple[KVCodec, KVTally]]) -> list[list[int]]:
    """Greedy continuations of the prefilled ``prompts`` as a decode pod runs them: blocks reserved, the prompt's
    KV written after its codec round trip, the sequence admitted with its first token; the generated tokens' KV is
    computed here, uncompressed."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = []
    for i, prompt in enumerate(prompts):
        seq = engine.reserve_for_transfer(f"agree-{i}", prompt.tokens, params)
        if seq is None:
            raise RuntimeError("the KV cache has no room for the agreement batch")
        write_round_trip(engine, seq, prompt.kv, codec, tally, sized)
        seqs.append(engine.admit_prefilled(seq, prompt.first_token))
    while engine.has_unfinished_requests():
        engine.step()
    _check_no_preemption(seqs)
    return [seq.output_token_ids for seq in seqs]


def _check_no_preemption(seqs: list[Sequence]) -> None:
    if any(seq.num_preemptions for seq in seqs):  # a re-prefill would have recomputed the KV losslessly
        raise RuntimeError("a sequence was preempted: the KV cache is too small for the agreement batch")


def agreement(reference: list[list[int]], outputs: list[list[int]]) -> tuple[float, int]:
    """(share of the reference's tokens generated before each continuation's first divergence, number of
    continuations equal in full)."""
    kept = sum(common_prefix(ref, out) for ref, out in zip(reference, outputs))
    return kept / sum(map(len, reference)), sum(ref == out for ref, out in zip(reference, outputs))


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
