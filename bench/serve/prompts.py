"""Prompts of exactly the token length a ``RequestSpec`` asks for, built before a run starts (the load generator
must not tokenize while it sends).

Prompts are token ids drawn from a seeded generator over the model's ordinary vocabulary: ids whose text encodes
back to that same single id, which leaves out control tokens (BOS, EOS, ChatML markers) and byte fragments that
are not text of their own. Sent as ``prompt: [ids]`` (HTTP) or ``token_ids`` (gRPC), they reach the engine as they
are, so their length is exact. Each request's tokens are its own (no accidental prefix-cache hits), except for an
optional shared prefix of ``shared_prefix`` tokens that every prompt starts with (to measure prefix caching).

As text (``text=True``), a prompt is the decoding of such ids, re-encoded and corrected a few times until the
router's tokenizer gives it the asked length; a prompt that does not converge keeps its closest length, and the
usage the server reports shows it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.measure.workload import RequestSpec

_TEXT_FIX_ATTEMPTS = 10


def ordinary_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids whose own text encodes back to exactly that id (no special tokens added)."""
    ids = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=True)
        if text and tokenizer.encode(text, add_special_tokens=False) == [token_id]:
            ids.append(token_id)
    if not ids:
        raise ValueError("the tokenizer has no ordinary tokens to build prompts from")
    return ids


@dataclass
class PromptFactory:
    """Seeded prompt builder over one tokenizer's ordinary vocabulary."""

    tokenizer: Tokenizer
    seed: int = 0
    shared_prefix: int = 0

    def __post_init__(self) -> None:
        self.vocabulary = ordinary_token_ids(self.tokenizer)
        self._prefix = self._draw(random.Random(f"{self.seed}-shared-prefix"), self.shared_prefix)

    def token_ids(self, spec: RequestSpec, run: int = 0) -> list[int]:
        """Request ``spec.index``'s prompt in run ``run`` of a sweep: ``spec.prompt_len`` ids (the shared prefix, then
        its own). Each run draws its own ids, so that no run's prompts hit the prefix cache its predecessors filled."""
        rng = random.Random(f"{self.seed}-run-{run}-prompt-{spec.index}")
        prefix = self._prefix[:spec.prompt_len]
        return prefix + self._draw(rng, spec.prompt_len - len(prefix))

    def text(self, spec: RequestSpec, run: int = 0) -> str:
        """Request ``spec.index``'s prompt as text that the tokenizer encodes to ``spec.prompt_len`` tokens (BOS
        included where the tokenizer adds one), when a few corrections get there."""
        rng = random.Random(f"{self.seed}-run-{run}-text-{spec.index}")
        ids = self.token_ids(spec, run)
        best = text = self.tokenizer.decode(ids)
        best_error = None
        for _ in range(_TEXT_FIX_ATTEMPTS):
            encoded = self.tokenizer.encode(text)
            error = len(encoded) - spec.prompt_len
            if best_error is None or abs(error) < abs(best_error):
                best, best_error = text, error
            if error == 0:
                break
            # Merges across token boundaries change the count: cut what is too long, extend what is too short.
            content = encoded[1:] if encoded[:1] == [self.tokenizer.bos_token_id] else encoded
            content = content[:len(content) - error] if error > 0 else content + self._draw(rng, -error)
            text = self.tokenizer.decode(content)
        return best

    def _draw(self, rng: random.Random, count: int) -> list[int]:
        return rng.choices(self.vocabulary, k=count) if count > 0 else []
