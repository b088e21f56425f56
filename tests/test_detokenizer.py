"""IncrementalDetokenizer: multi-byte characters arrive whole, the prompt is context and never output, stop strings
end the text (held back while they may begin, included on request). Fast tests use tiny-random's byte tokenizer,
where every byte is one token; model-marked ones use SmolLM2's real vocabulary."""

from __future__ import annotations

import pytest

from splitserve.engine.text.detokenizer import IncrementalDetokenizer
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.engine.text.tokenizer_files import smollm2_gguf_path, tiny_random_tokenizer_data
from splitserve.engine.weights.gguf_file import load_gguf

IM_START, IM_END = 1, 2
EMOJI = "Emoji: 😀🎉👍🏽 and flags 🇫🇷"
ACCENTS = "Accents: naïve café, Ärger, señor, Zürich. Ελληνικά, русский, 日本語"
CHAT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_gguf(tiny_random_tokenizer_data())


def stream(tokenizer, ids, prompt=(), **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, list(prompt), **kwargs)
    return [detok.add(i) for i in ids], detok


def test_multibyte_characters_arrive_whole(tiny):
    text = "aé😀世b"
    ids = tiny.encode(text)
    deltas, detok = stream(tiny, ids)
    # One token per byte: each character appears with its last byte, nothing before.
    assert deltas == ["a", "", "é", "", "", "", "😀", "", "", "世", "b"]
    assert detok.text == text and detok.finish() == "" and detok.text == text


def test_prompt_is_context_not_output(tiny):
    prompt = tiny.encode("<|im_start|>user\n世界<|im_end|>\n")
    deltas, detok = stream(tiny, tiny.encode("ok"), prompt=prompt)
    assert "".join(deltas) == detok.text == "ok"


def test_prompt_ending_inside_a_character_stays_out_of_the_output(tiny):
    # A prompt of token ids may end mid-character (here: 2 of 世's 3 bytes). Its decode ends in U+FFFD; the output
    # starts after it. (tokenizers' DecodeStream puts that U+FFFD at the front of the first output chunk.)
    prompt = tiny.encode("x世")[:-1]
    deltas, detok = stream(tiny, tiny.encode("ok"), prompt=prompt)
    assert deltas == ["o", "k"] and detok.finish() == "" and detok.text == "ok"


def test_unfinished_character_is_released_by_finish_as_a_full_decode_shows_it(tiny):
    ids = tiny.encode("x世")[:-1]  # the last byte never comes
    deltas, detok = stream(tiny, ids)
    assert deltas == ["x", "", ""]
    assert detok.finish() == "\ufffd" and detok.text == tiny.decode(ids) == "x\ufffd"


def test_stop_string_spanning_tokens_truncates(tiny):
    deltas, detok = stream(tiny, tiny.encode("Hello STOP and more"), stop=["STOP"])
    assert "".join(deltas) == detok.text == "Hello "
    assert detok.stopped_by == "STOP"
    assert detok.add(tiny.encode("x")[0]) == "" and detok.finish() == "" and detok.text == "Hello "


def test_stop_string_included_when_asked(tiny):
    deltas, detok = stream(tiny, tiny.encode("Hello STOP and more"), stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(deltas) == detok.text == "Hello STOP" and detok.stopped_by == "STOP"


def test_partial_stop_prefix_is_held_then_released(tiny):
    deltas, detok = stream(tiny, tiny.encode("a</b>c"), stop=["</s>"])
    assert deltas == ["a", "", "", "</b", ">", "c"]
    assert detok.stopped_by is None and detok.text == "a</b>c"


def test_held_prefix_released_by_finish(tiny):
    deltas, detok = stream(tiny, tiny.encode("hi\n"), stop=["\n\n"])
    assert deltas == ["h", "i", ""]
    assert detok.finish() == "\n" and detok.text == "hi\n"


def test_earliest_stop_wins(tiny):
    deltas, detok = stream(tiny, tiny.encode("xyz abc"), stop=["bc", "z a", "abc"])
    assert detok.stopped_by == "z a" and detok.text == "xy"


def test_multibyte_stop_string(tiny):
    deltas, detok = stream(tiny, tiny.encode("数据世界末日"), stop=["世界"])
    # 3 bytes a character; "世" is held as a stop prefix, "界" completes the stop, the rest is dropped.
    assert deltas == ["", "", "数", "", "", "据"] + [""] * 12
    assert detok.text == "数据" and detok.stopped_by == "世界"


def test_special_tokens_in_output(tiny):
    ids = tiny.encode("ok") + [IM_END]
    assert "".join(stream(tiny, ids)[0]) == "ok"
    assert "".join(stream(tiny, ids, skip_special_tokens=False)[0]) == "ok<|im_end|>"


def test_decodes_a_small_window_per_token(tiny):
    """The cost per token must not grow with the output: every decode sees a handful of ids."""
    sizes = []

    class Spy(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            sizes.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    spy = Spy.from_gguf(tiny_random_tokenizer_data())
    text = "streaming 世界 " * 60
    deltas, detok = stream(spy, tiny.encode(text), prompt=tiny.encode("a long prompt " * 20), stop=["never"])
    assert "".join(deltas) == detok.text == text
    assert max(sizes) <= 10


# ---- SmolLM2's real vocabulary ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer.from_gguf(load_gguf(smollm2_gguf_path())[2])


@pytest.mark.model
def test_smollm2_streaming_matches_full_decode(smollm2):
    text = EMOJI + " " + ACCENTS
    deltas, detok = stream(smollm2, smollm2.encode(text), prompt=smollm2.encode(CHAT))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == text
    deltas, detok = stream(smollm2, smollm2.encode(text), stop=["ñor, Zü"])
    assert detok.text == text[: text.index("ñor, Zü")] and detok.stopped_by == "ñor, Zü"
