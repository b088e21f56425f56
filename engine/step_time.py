"""The measured step-time model: how long an engine step takes, from what it holds, fitted online on the pod.

    time(step) ~= base [if it decodes] + per_decode_row * decode rows
                  + prefill_pass [if it prefills] + per_prefill_token * chunk tokens + per_context_token * context

where ``decode rows`` are the sequences that decode one token, ``chunk tokens`` the prompt tokens prefilled, and
``context`` the attention's work: over every token the step computes, the positions it attends to (a decode row at
position p: p + 1; a chunk of n tokens from position s: n * s + n * (n + 1) / 2, ``attention_positions``).
A step is weight-bound for decode rows (they share one pass over the file's weights: ``base`` is most of a decode
step), compute-bound for prompt tokens, and attention grows with the context. A step that prefills at all pays a
fixed ``prefill_pass`` of its own: the prefill path's pass over its weights (the bf16 copies, where prefill runs in
bf16: twice the bytes of the file's blocks), apart from the decode rows' pass. So a step that mixes both pays both
intercepts, as measured on a bf16 decode pod lent a prompt (AMD EPYC, SmolLM2, 2026-11-27): 3 decode rows and a
3-token chunk took 33-35 ms, a decode step of 3 rows ~10 ms and a 3-token chunk alone ~22 ms. A model with one
intercept, fitted on a decode pod's mostly decode-only steps, predicted that mixed step at 19 ms: the lent chunks
it sized broke the TPOT target they were sized to keep (issue 35).

``StepTimeFit`` keeps the engine's recent steps (``observe``, a sliding window) and refits the coefficients by
least squares every ``REFIT_EVERY`` steps. A decode pod's steps are mostly decode-only, which says nothing about a
prompt token's cost; so the fit keeps a *prior*: the pod's first ``prior_steps`` steps (its warm-up prefills and
decodes among them), always in the fit with the weight of ``prior_weight`` steps in all. Coefficients are kept
>= 0 (a step never gets faster with more work).

``StepTimeModel`` is the fitted coefficients: ``predict`` a step, and ``largest_chunk``, the most prompt tokens a
step may prefill beside given decode rows and still end within a time: the decode pod's per-step prefill chunk
(``engine/scheduler.py``) and the router's estimate of a lent prompt's TTFT (``router/policies.py``) both use it.
Pure Python (no torch, no numpy): the router imports it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

FEATURES = ("base", "per_decode_row", "per_prefill_token", "per_context_token", "prefill_pass")
WINDOW_STEPS = 256  # recent steps the fit uses: seconds of a busy pod, so it follows load from other processes
REFIT_EVERY = 8  # steps between refits (a 4x4 solve: microseconds)
PRIOR_STEPS = 32
PRIOR_WEIGHT = 16.0  # the prior counts as this many steps against the window's
# A lent prompt's chunk when no measured size fits: before any prompt token was measured, and on a pod with no
# decode running whose step is slower than its target (engine/prefill_budget.py; the router predicts the same).
PROBE_TOKENS = 16
# A decode pod lent a prompt (engine/prefill_budget.py; the router predicts the same, router/latency.py): a step may
# fill this share of its decodes' smallest TPOT slack (the fit's error and the engine loop's own time) ...
SLACK_HEADROOM = 0.8
# ... and no inter-token gap may pass this many TPOT targets, however much slack a request banked by decoding fast.
MAX_GAP_TARGETS = 4.0


@dataclass(frozen=True)
class StepSample:
    """One engine step as measured: what it computed and how long it took (seconds)."""

    decode_rows: int
    chunk_tokens: int
    context_tokens: int
    seconds: float

    def features(self) -> tuple[float, float, float, float, float]:
        return _features(self.decode_rows, self.chunk_tokens, self.context_tokens)


def _features(decode_rows: int, chunk_tokens: int, context_tokens: int) -> tuple[float, float, float, float, float]:
    """The step's terms, in ``FEATURES``' order: a step that prefills nothing (decodes, or an empty step) pays
    ``base``; one that prefills pays ``prefill_pass``; one that does both pays both."""
    decodes = 1.0 if decode_rows or not chunk_tokens else 0.0
    prefills = 1.0 if chunk_tokens else 0.0
    return decodes, float(decode_rows), float(chunk_tokens), float(context_tokens), prefills


def attention_positions(start: int, num_tokens: int) -> int:
    """Positions attended to by ``num_tokens`` tokens computed from position ``start`` (causal attention)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds of one step, linear in its decode rows, prompt tokens and attention context (module docstring)."""

    base: float = 0.0
    per_decode_row: float = 0.0
    per_prefill_token: float = 0.0
    per_context_token: float = 0.0
    prefill_pass: float = 0.0  # a prefilling step's fixed cost (module docstring)
    num_samples: int = 0  # steps the fit saw (0: nothing measured yet, every prediction is 0)

    @property
    def known(self) -> bool:
        """Whether it has measured a prompt token's cost (without that, it cannot size a chunk)."""
        return self.num_samples > 0 and self.per_prefill_token > 0

    def predict(self, decode_rows: int, chunk_tokens: int, context_tokens: int) -> float:
        terms = _features(decode_rows, chunk_tokens, context_tokens)
        return sum(c * x for c, x in zip(self.as_tuple(), terms))

    def largest_chunk(self, decode_rows: int, context_tokens: int, within_s: float, chunk_start: int = 0) -> int:
        """The most prompt tokens a step beside ``decode_rows`` decodes (their attention positions:
        ``context_tokens``) may prefill and still be predicted to take at most ``within_s``; the chunk starts at
        position ``chunk_start`` of its prompt. 0 when even the decodes alone do not fit, or when the model has not
        measured a prompt token yet."""
        if not self.known:
            return 0

        def fits(n: int) -> bool:
            return self.predict(decode_rows, n, context_tokens + attention_positions(chunk_start, n)) <= within_s

        if not fits(1):
            return 0
        low, high = 1, 2
        while fits(high):  # the time grows with the chunk: double, then bisect
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    def prefill_seconds(self, num_tokens: int) -> float:
        """A prompt of ``num_tokens`` prefilled in one step on an idle pod."""
        return self.predict(0, num_tokens, attention_positions(0, num_tokens))

    def as_tuple(self) -> tuple[float, float, float, float, float]:
        """The coefficients, in ``FEATURES``' order (the constructor's positional order)."""
        return self.base, self.per_decode_row, self.per_prefill_token, self.per_context_token, self.prefill_pass


class StepTimeFit:
    """The online fit of a pod's ``StepTimeModel`` (module docstring); engine thread only."""

    def __init__(self, window: int = WINDOW_STEPS, prior_steps: int = PRIOR_STEPS,
                 prior_weight: float = PRIOR_WEIGHT, refit_every: int = REFIT_EVERY):
        self.window: deque[StepSample] = deque(maxlen=window)
        self.prior_steps = prior_steps
        self.prior_weight = prior_weight
        self.refit_every = refit_every
        self.num_samples = 0
        self.first: list[StepSample] = []  # the prior: the pod's first steps, kept for good
        self._prior: tuple[float, ...] | None = None  # the prior's steps' own fit, once they are all in
        self.model = StepTimeModel()

    def observe(self, sample: StepSample) -> None:
        if sample.seconds <= 0:
            return
        self.num_samples += 1
        if len(self.first) < self.prior_steps:
            self.first.append(sample)
        else:
            self.window.append(sample)
        if self.num_samples <= self.prior_steps or self.num_samples % self.refit_every == 0:
            self.model = StepTimeModel(*self._fit(), num_samples=self.num_samples)

    def _fit(self) -> tuple[float, ...]:
        """Weighted least squares over the window and the prior's steps (together worth ``prior_weight``
        steps once the window has any), with a tiny ridge for the features no step has varied yet. A coefficient the
        fit would make negative keeps the prior's own value instead (``_nonnegative_fit``): recent steps that barely
        vary a feature cannot determine it. A decode pod lent prompts runs chunks of one size for a while; their
        time says ``prefill_pass + size * per_prefill_token`` and nothing of the two apart, and a machine slower than
        at warm-up tilted the fit to a negative token cost, clipped to 0: a model that "knew" no prompt token's cost
        and lent nothing more (measured under load, 2026-11-27)."""
        # Relative errors (each step weighs 1 / its time squared): a long prefill's noise must not drown a decode's.
        recent = [(s, 1.0 / s.seconds ** 2) for s in self.window]
        first = [(s, 1.0 / s.seconds ** 2) for s in self.first]
        if not recent:
            return _nonnegative_fit(first, fallback=(0.0,) * len(FEATURES))
        if self._prior is None and len(self.first) == self.prior_steps:
            self._prior = _nonnegative_fit(first, fallback=(0.0,) * len(FEATURES))
        # the prior's steps weigh as much, together, as prior_weight average recent ones
        scale = self.prior_weight / len(recent) * sum(w for _, w in recent) / sum(w for _, w in first)
        return _nonnegative_fit(recent + [(s, w * scale) for s, w in first],
                                fallback=self._prior or (0.0,) * len(FEATURES))


def _nonnegative_fit(weighted: list[tuple[StepSample, float]], fallback: tuple[float, ...]) -> tuple[float, ...]:
    """Least squares of the steps' seconds on their features; a coefficient that comes out negative is pinned to
    its ``fallback`` (clipped at 0) and the others refitted, until none is negative."""
    n = len(FEATURES)
    pinned: dict[int, float] = {}
    while True:
        free = [i for i in range(n) if i not in pinned]
        a = [[0.0] * len(free) for _ in free]
        b = [0.0] * len(free)
        for sample, weight in weighted:
            x = sample.features()
            rest = sample.seconds - sum(value * x[i] for i, value in pinned.items())
            for row, i in enumerate(free):
                b[row] += weight * x[i] * rest
                for col, j in enumerate(free):
                    a[row][col] += weight * x[i] * x[j]
        for row in range(len(free)):
            a[row][row] += 1e-9 * (a[row][row] or 1.0)
        solved = dict(zip(free, _solve(a, b)))
        negative = [i for i, value in solved.items() if value < 0]
        if not negative:
            return tuple(pinned[i] if i in pinned else solved[i] for i in range(n))
        for i in negative:
            pinned[i] = max(0.0, fallback[i])


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; ``a`` is positive definite (the ridge sees to it)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0:
            continue
        for r in range(col + 1, n):
            factor = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= factor * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        if m[r][r] == 0:
            continue
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
