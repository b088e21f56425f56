"""``Sampler``: turns one step's logits into one token per sequence, following each request's ``SamplingParams``.

A row's logits go through, in vLLM's order:

    token constraints       the grammar's mask and allowed_token_ids (every other token at -inf), bad words (the
                            token that would complete one at -inf), logit_bias (added)
    min_tokens masking      EOS (unless ignore_eos) and stop_token_ids at -inf until min_tokens are out
    repetition penalty      over prompt + output tokens, HF/CTRL style (positive / p, negative * p)
    presence, frequency     over output tokens, OpenAI's formula
    -> greedy rows: argmax
    -> other rows: temperature, top-k, top-p, min-p, then the draw

(top-k, top-p, min-p is HF's order and vLLM v0's; vLLM v1 moved min-p before top-k and top-p.)

Each filter is a small pure function on tensors with per-row parameters, applied only to the rows that asked
for it. They follow the ``transformers`` logits warpers of the same name: top-k keeps ties with the k-th logit;
top-p keeps the smallest set of most probable tokens reaching ``top_p``. All give HF's values exactly except
top-p, whose cumulative sums are taken over the head of the distribution (see ``apply_top_p``): a token whose
cumulative probability lies within float32 rounding of the cutoff may fall on the other side.

The draw is an exponential race: ``argmax(probs / E)`` with ``E ~ Exponential(1)`` i.i.d. per token picks
token ``i`` with probability ``probs[i]``, and needs nothing but one noise row per sequence. A seeded request
draws its row from a generator keyed by ``(seed, position)``, so it gets the same token alone, in any batch,
and on any pod of the same device type (prefill samples the first token, decode the rest). Unseeded rows
share the sampler's own generator.

Logprobs are those of the raw model distribution (log-softmax of the logits as given, before penalties,
temperature and filters), as vLLM v1 reports by default.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.engine.sampling.params import SamplingParams
from splitserve.engine.sequence import PromptLogprob


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence sampling this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    allowed: torch.Tensor | None = None  # [V] bool: the tokens its grammar allows next (structured output)

    @property
    def position(self) -> int:
        """Index in the sequence of the token being sampled."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Per row: {token_id: logprob} of the top-N tokens plus the sampled one, or None when not asked for.
    logprobs: list[dict[int, float] | None]


# --- filters: pure functions, per-row parameters as [N, 1] or [N] tensors --------------------------------------


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits: [N, V]; seen: [N, V] bool, tokens in prompt or output; penalty: [N, 1]."""
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def apply_presence_frequency_penalties(
    logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor
) -> torch.Tensor:
    """OpenAI: logit[j] - count[j] * frequency - (count[j] > 0) * presence. counts: [N, V] of output tokens."""
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """temperature: [N, 1], > 0 (greedy rows never get here)."""
    return logits / temperature


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the tokens whose logit is >= the k-th largest (ties kept, as HF). top_k: [N] long in [1, V]."""
    kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))  # [N, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


# Candidates top-p looks at before falling back to a full sort: nuclei of real models at usual temperatures
# are a few tokens to a few hundred.
TOP_P_HEAD = 256


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose probability reaches top_p. top_p: [N, 1] in (0, 1).

    HF's rule (drop a token when the probability of the tokens above it already reaches top_p; never drop the
    most probable one), with the cumulative sums taken top-down over the head of the distribution instead of
    bottom-up over a full sort: on CPU, sorting a 49k vocabulary costs several ms per row, the head a fraction
    of one. Rows whose nucleus does not fit in the head fall back to the full sort.
    """
    probs = logits.softmax(dim=-1)  # [N, V]
    keep = torch.zeros_like(probs, dtype=torch.bool)
    head_probs, head_ids = probs.topk(min(TOP_P_HEAD, probs.shape[-1]), dim=-1)  # [N, H], descending
    keep.scatter_(1, head_ids, _within_nucleus(head_probs, top_p))
    overflow = (head_probs.sum(dim=-1, keepdim=True) < top_p).squeeze(1).nonzero().squeeze(1)  # [M]
    if overflow.numel():
        all_probs, all_ids = probs[overflow].sort(dim=-1, descending=True)  # [M, V]
        keep[overflow] = keep[overflow].scatter(1, all_ids, _within_nucleus(all_probs, top_p[overflow]))
    return logits.masked_fill(~keep, float("-inf"))


def _within_nucleus(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """sorted_probs: [N, H] descending. A token stays while the mass strictly above it is below top_p."""
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    return mass_above < top_p


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most probable one's. min_p: [N, 1]."""
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))


def exponential_race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """One draw per row from probs [N, V], given Exponential(1) noise [N, V] (> 0). Returns [N] long."""
    return (probs / noise).argmax(dim=-1)


def banned_by_bad_words(bad_words_token_ids: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The tokens that would complete a bad word now: a one-token word always, a longer one when the output
    ends with all of it but its last token (vLLM's rule: only the output counts, not the prompt)."""
    banned = []
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or output_token_ids[len(output_token_ids) - len(prefix):] == prefix:
            banned.append(word[-1])
    return banned


def seeded_draw_key(seed: int, position: int) -> int:
    """63-bit generator key for (seed, position); hashlib, because Python's hash() is salted per process."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed, position), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def top_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, num_top: list[int]) -> list[dict[int, float]]:
    """Per row: the num_top[i] most probable tokens and the sampled one -> logprob. logprobs: [M, V]; sampled: [M]."""
    k = max(num_top)
    top_values, top_ids = logprobs.topk(k, dim=-1)  # [M, k]
    sampled_values = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)  # [M]
    rows = zip(top_ids.tolist(), top_values.tolist(), sampled.tolist(), sampled_values.tolist(), num_top)
    result = []
    for ids, values, token, value, n in rows:
        entry = dict(zip(ids[:n], values[:n]))
        entry[token] = value
        result.append(entry)
    return result


def prompt_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[PromptLogprob]:
    """Per row: the prompt token's logprob and rank, and the num_top most probable tokens. logprobs: [M, V] (the
    log-softmax at the positions before the tokens); token_ids: [M] long, the prompt's tokens."""
    actual = logprobs.gather(1, token_ids.unsqueeze(1))  # [M, 1]
    ranks = (logprobs > actual).sum(dim=-1) + 1  # [M]; ties share the better rank
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [M, num_top]
    rows = zip(token_ids.tolist(), actual.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_values.tolist())
    return [PromptLogprob(token, value, rank, dict(zip(ids, values))) for token, value, rank, ids, values in rows]


# --- the sampler -------------------------------------------------------------------------------------------------


class Sampler:
    """One per model runner. ``sample`` runs once per step over the rows that sample; ``penalize`` and ``warp``
    are its two halves (HF's "logits processors" and "warpers"), public so they can be checked on their own.
    Neither modifies the tensor it is given."""

    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: str | torch.device = "cpu", seed: int = 0):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)  # for unseeded requests
        self._generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: [N, V] float32, row i for rows[i]."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits must be [{len(rows)}, {self.vocab_size}], got {list(logits.shape)}")
        params = [row.params for row in rows]
        wants_logprobs = any(p.logprobs is not None for p in params)
        if all(p.is_greedy for p in params) and not wants_logprobs and not any(map(_changes_logits, rows)):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(rows))

        processed = self.penalize(logits, rows)
        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)  # [N]
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        if greedy:
            token_ids[greedy] = _select_rows(processed, greedy).argmax(dim=-1)
        drawn = [i for i, p in enumerate(params) if not p.is_greedy]
        if drawn:
            drawn_rows = [rows[i] for i in drawn]
            warped = self.warp(_select_rows(processed, drawn), [row.params for row in drawn_rows])
            noise = self._exponential_noise(drawn_rows, logits.device)
            token_ids[drawn] = exponential_race(warped.softmax(dim=-1), noise)

        logprobs: list[dict[int, float] | None] = [None] * len(rows)
        if wants_logprobs:
            asked = [i for i, p in enumerate(params) if p.logprobs is not None]
            raw = _select_rows(logits, asked).float().log_softmax(dim=-1)  # [M, V]
            entries = top_logprobs(raw, token_ids[asked], [params[i].logprobs for i in asked])
            for i, entry in zip(asked, entries):
                logprobs[i] = entry
        return SamplerOutput(token_ids.tolist(), logprobs)

    def penalize(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """logits [N, V] after token constraints, min_tokens masking, repetition and presence/frequency
        penalties."""
        logits = self._constrain_tokens(logits, rows)
        logits = self._block_stop_tokens(logits, rows)
        repeating = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
        if repeating:
            histories = [rows[i].prompt_token_ids + rows[i].output_token_ids for i in repeating]
            seen = self._token_counts(histories, logits.device) > 0
            penalty = self._column([rows[i].params.repetition_penalty for i in repeating], logits)
            logits = _on_rows(logits, repeating, lambda x: apply_repetition_penalty(x, seen, penalty))
        penalizing = [i for i, row in enumerate(rows) if row.params.presence_penalty or row.params.frequency_penalty]
        if penalizing:
            counts = self._token_counts([rows[i].output_token_ids for i in penalizing], logits.device)
            presence = self._column([rows[i].params.presence_penalty for i in penalizing], logits)
            frequency = self._column([rows[i].params.frequency_penalty for i in penalizing], logits)
            logits = _on_rows(
                logits, penalizing, lambda x: apply_presence_frequency_penalties(x, counts, presence, frequency)
            )
        return logits

    def warp(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p on logits [R, V] of non-greedy rows; filtered tokens at -inf."""
        logits = apply_temperature(logits, self._column([p.temperature for p in params], logits))
        top_k = [i for i, p in enumerate(params) if 0 < p.top_k < self.vocab_size]
        if top_k:
            k = torch.tensor([params[i].top_k for i in top_k], dtype=torch.long, device=logits.device)
            logits = _on_rows(logits, top_k, lambda x: apply_top_k(x, k))
        top_p = [i for i, p in enumerate(params) if p.top_p < 1.0]
        if top_p:
            p = self._column([params[i].top_p for i in top_p], logits)
            logits = _on_rows(logits, top_p, lambda x: apply_top_p(x, p))
        min_p = [i for i, p in enumerate(params) if p.min_p > 0.0]
        if min_p:
            m = self._column([params[i].min_p for i in min_p], logits)
            logits = _on_rows(logits, min_p, lambda x: apply_min_p(x, m))
        return logits

    def _constrain_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The grammar's mask, allowed_token_ids, bad words and logit_bias, on the rows that have them (few: a loop
        over them)."""
        constrained = [i for i, row in enumerate(rows) if row.params.constrains_tokens or row.allowed is not None]
        if not constrained:
            return logits
        logits = logits.clone()
        for i in constrained:
            params, row = rows[i].params, logits[i]  # row: [V], a view of logits
            if rows[i].allowed is not None:
                row.masked_fill_(~rows[i].allowed.to(row.device), float("-inf"))
            if params.allowed_token_ids is not None:
                allowed = torch.zeros_like(row, dtype=torch.bool)
                allowed[self._in_vocabulary(params.allowed_token_ids)] = True
                row.masked_fill_(~allowed, float("-inf"))
            banned = self._in_vocabulary(banned_by_bad_words(params.bad_words_token_ids, rows[i].output_token_ids))
            row[banned] = float("-inf")
            biased = [(t, b) for t, b in params.logit_bias.items() if t < self.vocab_size]
            if biased:
                ids, biases = zip(*biased)
                row[list(ids)] += torch.tensor(biases, dtype=row.dtype, device=row.device)
        return logits

    def _in_vocabulary(self, token_ids: list[int]) -> list[int]:
        # The router checks ids against the tokenizer's vocabulary, which may be smaller than the model's rows;
        # an id past the logits can never be sampled, so constraining it is a no-op.
        return [t for t in token_ids if t < self.vocab_size]

    def _block_stop_tokens(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """While a row has fewer than min_tokens outputs, it may not sample a token that would end it."""
        blocked_rows, blocked_tokens = [], []
        for i, row in enumerate(rows):
            if len(row.output_token_ids) >= row.params.min_tokens:
                continue
            stops = set(row.params.stop_token_ids)
            if not row.params.ignore_eos:
                stops.update(self.eos_token_ids)
            # A stop id outside the vocabulary can never be sampled: nothing to block.
            stops = sorted(t for t in stops if t < self.vocab_size)
            blocked_rows += [i] * len(stops)
            blocked_tokens += stops
        if not blocked_rows:
            return logits
        logits = logits.clone()
        logits[blocked_rows, blocked_tokens] = float("-inf")
        return logits

    def _exponential_noise(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """[R, V] Exponential(1) noise as -log(U), U ~ Uniform[0, 1): four times cheaper on CPU than
        ``exponential_``, and never 0 (U < 1), so a filtered token's 0 / noise stays 0, never NaN."""
        uniform = torch.empty(len(rows), self.vocab_size, device=device)  # [R, V]
        unseeded = [i for i, row in enumerate(rows) if row.params.seed is None]
        if len(unseeded) == len(rows):
            uniform.uniform_(generator=self._generator)
        elif unseeded:
            uniform[unseeded] = uniform[unseeded].uniform_(generator=self._generator)
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                generator = torch.Generator(device=device)
                generator.manual_seed(seeded_draw_key(row.params.seed, row.position))
                uniform[i].uniform_(generator=generator)  # a fresh [V] stream, whatever the batch
        return uniform.log_().neg_()  # U = 0 gives +inf: that token just loses the race

    @staticmethod
    def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)  # [R, 1]

    def _token_counts(self, token_lists: list[list[int]], device: torch.device) -> torch.Tensor:
        """[R, V] float32: how many times each token occurs in each row's list."""
        counts = torch.zeros(len(token_lists), self.vocab_size, device=device)
        lengths = torch.tensor([len(tokens) for tokens in token_lists], device=device)
        row_ids = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
        token_ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=device)
        counts.index_put_((row_ids, token_ids), torch.ones_like(token_ids, dtype=counts.dtype), accumulate=True)
        return counts


def _select_rows(x: torch.Tensor, ids: list[int]) -> torch.Tensor:
    # Every row selected (the usual batch): the tensor itself, not a gathered copy of it.
    return x if len(ids) == x.shape[0] else x[ids]


def _on_rows(x: torch.Tensor, ids: list[int], fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn applied to the rows ids of x, out of place (fn itself is out of place)."""
    if len(ids) == x.shape[0]:
        return fn(x)
    out = x.clone()
    out[ids] = fn(x[ids])
    return out


def _changes_logits(row: SamplingRow) -> bool:
    p = row.params
    return (
        p.repetition_penalty != 1.0
        or p.presence_penalty != 0.0
        or p.frequency_penalty != 0.0
        or len(row.output_token_ids) < p.min_tokens
        or p.constrains_tokens
        or row.allowed is not None
    )
