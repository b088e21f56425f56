"""Speculative decoding: propose a few tokens cheaply, verify them all in one model step, keep those the model agrees
with. A decode step reads every weight to produce one token per sequence; verifying k proposed tokens in the same
step reads them once too, so each accepted proposal is a token for the price of one more row.

A decoding request's path, one engine step at a time:

- ``SpeculativeProposer.propose`` (before the scheduler runs): the request's ``DraftLength`` says how many tokens
  are worth proposing now (its acceptance so far, against what one more row costs in a step of this many rows), and
  its ``NgramIndex`` proposes them: the tokens that followed the latest earlier occurrence of the sequence's last n
  tokens in its prompt and output (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``), as vLLM's ``ngram``
  and llama.cpp's lookup decoding do. They go to ``seq.draft_token_ids``;
- the scheduler gives the sequence 1 + k new tokens (its last token and k drafts; fewer drafts when the token budget,
  ``max_tokens`` or the context would be passed) and the runner verifies them as k + 1 *decode rows* of one step:
  row j is the decode step that would run at position start + j had drafts 0..j-1 been sampled, attending to keys
  0..start + j through the sequence's block table. Same kernels, same keys, same bits as decoding one at a time;
- ``accept_drafts``: each row's token is sampled as sequential decoding would sample it (penalties and min_tokens
  over the output plus the drafts before it, a seeded draw keyed by (seed, position)); row j's token is emitted,
  and while it equals draft j the next row's token follows. The first mismatch ends the step with the model's own
  token in its place; when all k drafts match, row k's token is a bonus;
- the scheduler appends the emitted tokens one by one, checking the stop conditions after each (nothing past a stop
  token or ``max_tokens``), and advances the computed tokens by the rows whose inputs were accepted. The rejected
  rows' KV slots lie past the computed tokens: no later row attends to them (a row's keys end at its own position)
  and the next step writes over them.

Why this is exact. Greedy: every emitted token is the argmax of the very logits sequential decoding computes, so
the output is identical token for token. Sampling: the draft is a point mass on token d, for which the rejection
rule that keeps the target distribution p (accept d with probability min(1, p(d) / q(d)) = p(d); on rejection draw
from the residual max(0, p - q), i.e. p without d, renormalised) is exactly "draw t ~ p; accept if t == d, else emit
t": both accept with probability p(d), and a rejected step's token is p conditioned on t != d. Drawing t with the
sampler's own noise keyed by (seed, position) also keeps a seeded request's tokens those of decoding without
speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.config import SpeculativeConfig
from splitserve.engine.sequence import Sequence
from splitserve.engine.speculative.state import DraftLength, DraftState, NgramIndex, ngrams


def accept_drafts(sampled: list[int], drafts: list[int]) -> int:
    """How many of the verification rows' tokens ``sampled`` (k + 1 of them) are emitted, given the k ``drafts``:
    the rows up to the first whose token differs from its draft, that one included; all k + 1 when every draft
    matches."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return accepted + 1


class ResponseCache:
    """The ``suffix`` method's memory of the pod's recent responses: every n-gram of the last
    ``max_responses`` responses (each with the end of its prompt, so that an answer's first tokens are found too),
    mapped to where its latest occurrence ends. Agents and code tools send requests whose answers repeat earlier
    ones; a request's suffix found here proposes what followed it there."""

    def __init__(self, n_min: int, n_max: int, max_responses: int):
        self.n_min, self.n_max, self.max_responses = n_min, n_max, max_responses
        self._responses: dict[int, list[int]] = {}  # response number -> its tokens, oldest first
        self._ends: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (response number, end)
        self._count = 0

    def add(self, seq: Sequence) -> None:
        tokens = seq.prompt_token_ids[-self.n_max:] + seq.output_token_ids
        number, self._count = self._count, self._count + 1
        self._responses[number] = tokens
        for ngram, end in ngrams(tokens, self.n_min, len(tokens) - 1, self.n_min, self.n_max):
            self._ends[ngram] = (number, end)
        if len(self._responses) > self.max_responses:
            self._forget(next(iter(self._responses)))

    def _forget(self, number: int) -> None:
        tokens = self._responses.pop(number)
        for ngram, _ in ngrams(tokens, self.n_min, len(tokens) - 1, self.n_min, self.n_max):
            if self._ends.get(ngram, (None,))[0] == number:
                del self._ends[ngram]

    def match(self, tail: list[int]) -> tuple[int, list[int]] | None:
        """(n, the tokens that followed) for the longest suffix of ``tail`` found; None when none is."""
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
            found = self._ends.get(tuple(tail[len(tail) - n:]))
            if found is not None:
                number, end = found
                return n, self._responses[number][end:]
        return None


@dataclass
class SpecDecodeCounts:
    """What speculation did, counted as vLLM's ``spec_decode`` metrics count it."""

    num_drafts: int = 0  # verification rows groups: steps x requests that proposed
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i

    def add(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_proposed:
            self.accepted_per_position += [0] * (num_proposed - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


class SpeculativeProposer:
    """The engine's proposer: ``propose`` before each step, ``observe`` after it, ``finished`` as a request ends.

    ``draft_model`` (the ``draft`` method: engine/speculative/draft_model.py) proposes with a model, into slots that
    ``block_manager`` allocates for the drafts before the scheduler runs; ``draft_cost`` is what one draft step costs
    next to a target step."""

    def __init__(self, config: SpeculativeConfig, draft_model=None, block_manager=None, draft_cost: float = 0.0):
        self.config = config
        self.draft_model, self.block_manager = draft_model, block_manager
        self.draft_cost = config.row_cost + draft_cost
        self.responses = None
        if config.method == "suffix":
            self.responses = ResponseCache(config.prompt_lookup_min, config.prompt_lookup_max,
                                           config.suffix_decoding_max_cached_requests)

    def propose(self, decoding: list[Sequence]) -> None:
        """Set ``draft_token_ids`` of each sequence that decodes next step (``decoding``, all of them)."""
        step_cost, step_tokens = 1 + self.config.row_cost * len(decoding), float(len(decoding))
        by_model: list[tuple[Sequence, int]] = []
        for seq in decoding:
            state = seq.speculation or self._new_state(seq)
            k = state.length.choose(step_cost, step_tokens, self.draft_cost)
            seq.draft_token_ids = []
            if self.draft_model is None:
                seq.draft_token_ids = self._lookup(seq, state, k) if k else []
                k = len(seq.draft_token_ids)
            elif k and self.block_manager.allocate_slots(seq, k):  # the draft writes KV at the drafts' positions
                by_model.append((seq, k))
            else:
                k = 0
            step_cost += self.draft_cost * k
            step_tokens += state.length.expected_tokens(k) - 1
        if by_model:
            self.draft_model.propose([seq for seq, _ in by_model], [k for _, k in by_model])

    def _lookup(self, seq: Sequence, state: DraftState, k: int) -> list[int]:
        if self.responses is None:
            return state.index.propose(seq, k)
        # suffix: the longer match of the request's own tokens and the pod's recent responses (its own on a tie).
        own = state.index.match(seq)
        cached = self.responses.match(seq.token_slice(max(0, seq.num_tokens - self.config.prompt_lookup_max),
                                                      seq.num_tokens))
        if cached is not None and (own is None or cached[0] > own[0]):
            return cached[1][:k]
        return state.index.following(seq, own[1], k) if own is not None else []

    def observe(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """The step verified ``num_proposed`` drafts of ``seq`` and accepted ``num_accepted`` (before its tokens are
        appended)."""
        seq.speculation.length.observe(num_proposed, num_accepted)
        if self.draft_model is not None:
            # The draft's KV holds the tokens it fed back, d0..d(k-2): those accepted are the sequence's now.
            seq.speculation.draft_computed = seq.num_tokens + min(num_accepted, num_proposed - 1)
            seq.speculation.draft_preemptions = seq.num_preemptions

    def finished(self, seq: Sequence) -> None:
        """A request ended (finished or aborted): the suffix method remembers its response."""
        if self.responses is not None and seq.output_token_ids:
            self.responses.add(seq)

    def _new_state(self, seq: Sequence) -> DraftState:
        config = self.config
        seq.speculation = DraftState(NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max),
                                     DraftLength(config.num_speculative_tokens, config.adaptive))
        return seq.speculation
