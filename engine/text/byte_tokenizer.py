"""A byte-level tokenizer's files for a checkpoint directory built in code: the random-weight checkpoints the tests
and ``splitserve bench moe`` build with ``transformers`` (no model hub here), which ``LLM(model=DIRECTORY)`` loads
as it loads any Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

SPECIAL_TOKENS = ["<s>", "</s>"]  # ids 0 and 1


def write_byte_level_tokenizer(directory: Path, vocab_size: int, generation_eos: list[int] | None = None) -> None:
    """tokenizer.json of ``vocab_size`` tokens (the two special ones, then byte-level characters: up to 258 in all),
    tokenizer_config.json naming them BOS and EOS, and, with ``generation_eos``, a generation_config.json."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size > len(SPECIAL_TOKENS) + len(alphabet):
        raise ValueError(f"a byte-level vocabulary without merges has at most {len(alphabet) + 2} tokens")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + alphabet[: vocab_size - len(SPECIAL_TOKENS)])}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    if generation_eos is not None:
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
