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

# How fast a request's acceptance history forgets: the weight of the older observations after each new one.
ACCEPTANCE_DECAY = 0.8
# The acceptance rate a request starts from (as this many pseudo-observations), before its own proposals are judged.
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.5, 2.0
# A request that stopped speculating proposes one token again after this many steps, doubling up to the maximum
# while those probes fail: what it pays for finding out that its text became predictable is a fraction of a row.
FIRST_BACKOFF_STEPS, MAX_BACKOFF_STEPS = 4, 64


def accept_drafts(sampled: list[int], drafts: list[int]) -> int:
    """How many of the verification rows' tokens ``sampled`` (k + 1 of them) are emitted, given the k ``drafts``:
    the rows up to the first whose token differs from its draft, that one included; all k + 1 when every draft
    matches."""
    accepted = 0
    while accepted < len(drafts) and sampled[accepted] == drafts[accepted]:
        accepted += 1
    return accepted + 1


class NgramIndex:
    """Where the latest occurrence of every n-gram (``n_min`` <= n <= ``n_max``) of one sequence's tokens ends,
    built incrementally as the sequence grows; ``propose`` looks the sequence's last n tokens up in it."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest indexed occurrence
        self._indexed_to = 0  # n-grams ending at indices < this are indexed

    def match(self, seq: Sequence) -> tuple[int, int] | None:
        """(n, end) of the longest suffix of ``seq`` that occurred before, ending at ``end``; None if none did."""
        num_tokens = seq.num_tokens
        # Index every n-gram that ends before the last token: the suffix itself must not be its own match.
        if num_tokens - 1 > self._indexed_to:
            start = max(0, self._indexed_to - self.n_max + 1)
            tokens = seq.token_slice(start, num_tokens - 1)
            for ngram, end in ngrams(tokens, self._indexed_to + 1 - start, len(tokens), self.n_min, self.n_max):
                self._ends[ngram] = start + end
            self._indexed_to = num_tokens - 1
        tail = seq.token_slice(max(0, num_tokens - self.n_max), num_tokens)
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
            end = self._ends.get(tuple(tail[len(tail) - n:]))
            if end is not None:
                return n, end
        return None

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """``k`` tokens that followed the latest earlier occurrence of the longest suffix found (none when no suffix
        of at least ``n_min`` tokens occurred before)."""
        found = self.match(seq)
        return [] if found is None else self.following(seq, found[1], k)

    @staticmethod
    def following(seq: Sequence, end: int, k: int) -> list[int]:
        """``k`` tokens of ``seq`` from ``end``, where a match ended, continued as an overlapping copy."""
        num_tokens = seq.num_tokens
        return _copy_on(seq.token_slice(end, min(end + k, num_tokens)), num_tokens - end, k)


def ngrams(tokens: list[int], first_end: int, last_end: int, n_min: int, n_max: int):
    """(n-gram, end) of every n-gram of ``tokens`` ending at ``first_end`` .. ``last_end`` (exclusive ends, both
    included), ``n_min`` <= n <= ``n_max``, shorter ones first."""
    for end in range(max(first_end, n_min), last_end + 1):
        for n in range(n_min, min(n_max, end) + 1):
            yield tuple(tokens[end - n:end]), end


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


def _copy_on(copied: list[int], period: int, k: int) -> list[int]:
    """``copied`` (the tokens from the match to the end) continued to ``k`` tokens the way a copy that overlaps
    its own output goes on (as LZ77's): a match ``period`` tokens back proposes the loop it is in."""
    while len(copied) < k:
        copied.append(copied[len(copied) - period])
    return copied


@dataclass
class DraftLength:
    """How many tokens one request proposes next, from its acceptance so far.

    Acceptance is modelled per position (a draft is accepted with probability ``a`` once the ones before it were),
    estimated from the request's recent steps: a step that proposed k and accepted m judged min(m + 1, k) drafts and
    accepted m. Proposing k tokens yields 1 + a + ... + a^k tokens per step and costs k more rows (and, for a draft
    model, k draft steps); ``choose`` takes the k that most raises the step's tokens per second, given the cost and
    tokens the step already has. When that
    is none, the request stops speculating and probes again later with a single token (backing off while it fails).
    """

    max_tokens: int
    adaptive: bool
    accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT  # decayed counts
    judged: float = PRIOR_WEIGHT
    skip_steps: int = 0  # steps left without proposing (after speculation stopped paying)
    backoff: int = FIRST_BACKOFF_STEPS

    @property
    def acceptance(self) -> float:
        return self.accepted / self.judged

    def choose(self, step_cost: float, step_tokens: float, draft_cost: float) -> int:
        """Tokens to propose, joining a step that costs ``step_cost`` (1: the step's fixed cost, reading the weights;
        each row and each proposal adds its share) and is expected to yield ``step_tokens`` tokens (this request's
        own row and token included), where each draft adds ``draft_cost``."""
        if not self.adaptive:
            return self.max_tokens
        if self.skip_steps > 0:
            self.skip_steps -= 1
            return 1 if self.skip_steps == 0 else 0  # the probe
        a = self.acceptance
        best_k, best_rate = 0, step_tokens / step_cost
        gain = 0.0
        for k in range(1, self.max_tokens + 1):
            gain += a**k
            rate = (step_tokens + gain) / (step_cost + draft_cost * k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            self.skip_steps = self.backoff
            self.backoff = min(2 * self.backoff, MAX_BACKOFF_STEPS)
        return best_k

    def expected_tokens(self, k: int) -> float:
        """1 + a + ... + a^k: the tokens a step with k drafts yields on average."""
        return sum(self.acceptance**i for i in range(k + 1))

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.accepted = ACCEPTANCE_DECAY * self.accepted + num_accepted
        self.judged = ACCEPTANCE_DECAY * self.judged + min(num_accepted + 1, num_proposed)
        if num_accepted:
            self.backoff = FIRST_BACKOFF_STEPS


@dataclass
class DraftState:
    """A request's speculation: its n-gram index, its draft length, and how many of its tokens a draft model's KV
    holds (engine/speculative/draft_model.py)."""

    index: NgramIndex
    length: DraftLength
    draft_computed: int = 0
    draft_preemptions: int = 0  # seq.num_preemptions when draft_computed was set: a preemption drops the KV


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
