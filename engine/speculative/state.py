"""A request's speculation state, as its ``Sequence`` carries it (``Sequence.speculation``): what the proposer
(``proposer.py``) keeps per request from one step to the next.

- ``NgramIndex``: where the latest occurrence of every n-gram of the request's tokens ends, grown as it does; the
  proposer looks the request's last n tokens up in it and proposes what followed;
- ``DraftLength``: how many tokens the request proposes next, from its acceptance so far;
- ``DraftState``: the two, and how many of its tokens a draft model's KV holds (``draft_model.py``).

Nothing here imports the sequence: the index reads a request's tokens through ``TokenHistory``, which ``Sequence``
is, so that ``sequence.py`` can name ``DraftState`` as ``structured_output/grammar.py``'s ``GrammarState`` is named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# How fast a request's acceptance history forgets: the weight of the older observations after each new one.
ACCEPTANCE_DECAY = 0.8
# The acceptance rate a request starts from (as this many pseudo-observations), before its own proposals are judged.
PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.5, 2.0
# A request that stopped speculating proposes one token again after this many steps, doubling up to the maximum
# while those probes fail: what it pays for finding out that its text became predictable is a fraction of a row.
FIRST_BACKOFF_STEPS, MAX_BACKOFF_STEPS = 4, 64


class TokenHistory(Protocol):
    """A request's tokens, prompt then output, as the index reads them (``Sequence``'s)."""

    @property
    def num_tokens(self) -> int: ...

    def token_slice(self, start: int, end: int) -> list[int]: ...


class NgramIndex:
    """Where the latest occurrence of every n-gram (``n_min`` <= n <= ``n_max``) of one sequence's tokens ends,
    built incrementally as the sequence grows; ``propose`` looks the sequence's last n tokens up in it."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> index just past its latest indexed occurrence
        self._indexed_to = 0  # n-grams ending at indices < this are indexed

    def match(self, seq: TokenHistory) -> tuple[int, int] | None:
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

    def propose(self, seq: TokenHistory, k: int) -> list[int]:
        """``k`` tokens that followed the latest earlier occurrence of the longest suffix found (none when no suffix
        of at least ``n_min`` tokens occurred before)."""
        found = self.match(seq)
        return [] if found is None else self.following(seq, found[1], k)

    @staticmethod
    def following(seq: TokenHistory, end: int, k: int) -> list[int]:
        """``k`` tokens of ``seq`` from ``end``, where a match ended, continued as an overlapping copy."""
        num_tokens = seq.num_tokens
        return _copy_on(seq.token_slice(end, min(end + k, num_tokens)), num_tokens - end, k)


def ngrams(tokens: list[int], first_end: int, last_end: int, n_min: int, n_max: int):
    """(n-gram, end) of every n-gram of ``tokens`` ending at ``first_end`` .. ``last_end`` (exclusive ends, both
    included), ``n_min`` <= n <= ``n_max``, shorter ones first."""
    for end in range(max(first_end, n_min), last_end + 1):
        for n in range(n_min, min(n_max, end) + 1):
            yield tuple(tokens[end - n:end]), end


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
