"""``GrammarMasks``: the token masks of a step's structured-output sequences, computed while the model runs.

    ModelRunner.execute:
        pending = masks.start(seqs)       before the forward pass: a worker thread catches each sequence's matcher up
                                          with its output tokens, then llguidance's executor fills one bitmask row per
                                          sequence on its own threads, without the GIL
        hidden = model(...)               meanwhile
        allowed = pending.result()        {request_id: [V] bool}, each row's allowed tokens -> SamplingRow.allowed

A sequence's matcher lives on the sequence (``Sequence.grammar``) and is rebuilt from its output tokens wherever it
runs: the prefill pod starts it empty and samples the first token under it; the decode pod's copy starts from the
transferred sequence and consumes that first token; a migrated request replays its resumed tokens. So the grammar
needs no wire format of its own: the tokens so far are its state.

A matcher in an error state (a grammar that does not compile on this pod, a token it did not allow) allows EOS
only, so that the request ends instead of producing output that cannot match.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance

# Not llguidance.torch: it imports torch.compile's machinery (seconds of every pod's start, ~120 MiB of its memory).
import llguidance.numpy
import torch

from splitserve.engine.sequence import Sequence
from splitserve.engine.structured_output.grammar import GrammarCompiler, GrammarState

log = logging.getLogger(__name__)


class GrammarMasks:
    """Per-step masks for the sequences that asked for structured output; one per model runner."""

    def __init__(self, compiler: GrammarCompiler, vocab_size: int, eos_token_ids: list[int]):
        self.compiler = compiler
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._executor: llguidance.LLExecutor | None = None  # llguidance's threads, made on first use

    def start(self, seqs: list[Sequence]) -> Future | None:
        """Begin the masks of the guided sequences among ``seqs``; None when none is guided."""
        guided = [seq for seq in seqs if seq.sampling_params.structured_output is not None]
        return self._worker.submit(self.masks, guided) if guided else None

    def masks(self, seqs: list[Sequence]) -> dict[str, torch.Tensor]:
        """{request_id: [V] bool}, True where the token is allowed next."""
        matchers = [self._caught_up(seq) for seq in seqs]
        bitmask = llguidance.numpy.allocate_token_bitmask(len(seqs), self.vocab_size)  # every bit set
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        working = [(matcher, i) for i, matcher in enumerate(matchers) if not matcher.is_error()]
        if working:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, working, bitmask)
        allowed = unpack_bitmask(torch.from_numpy(bitmask), self.vocab_size)  # [R, V]
        for i, matcher in enumerate(matchers):
            if matcher.is_error():
                allowed[i] = False
                allowed[i, self.eos_token_ids] = True
        return {seq.request_id: allowed[i] for i, seq in enumerate(seqs)}

    def _caught_up(self, seq: Sequence) -> llguidance.LLMatcher:
        """The sequence's matcher, made on first use and fed the output tokens it has not seen."""
        state = seq.grammar
        if state is None:
            state = seq.grammar = GrammarState(self.compiler.matcher(seq.sampling_params.structured_output))
            if state.matcher.is_error():
                log.warning("request %s: its grammar does not compile (%s); only EOS is allowed", seq.request_id,
                            state.matcher.get_error())
        new_tokens = seq.output_token_ids[state.consumed:]
        if new_tokens and not state.matcher.is_error() and not state.matcher.consume_tokens(new_tokens):
            log.warning("request %s: its output left its grammar (%s); only EOS is allowed now", seq.request_id,
                        state.matcher.get_error())
        state.consumed = seq.num_output_tokens
        return state.matcher


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's bitmask [R, W] int32 (bit j of word w: token 32 w + j) -> [R, vocab_size] bool."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [R, W, 32]
    return bits.flatten(1)[:, :vocab_size].bool()
