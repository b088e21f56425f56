"""StopStringMatcher: the same answers as a search of the whole text (earliest stop string, the longest at that
start; the held-back tail), fed in any pieces; and a cost per token that does not grow with the output or with
the number of stop strings as the old search of every stop string at every token did."""

from __future__ import annotations

import random
import time

import pytest

from splitserve.engine.text.detokenizer import IncrementalDetokenizer
from splitserve.engine.text.stop_strings import StopMatch, StopStringMatcher
from splitserve.engine.text.tokenizer import Tokenizer
from splitserve.engine.text.tokenizer_files import tiny_random_tokenizer_data


def whole_text_answer(text: str, stops: list[str]) -> StopMatch | int:
    """The first stop string in ``text`` (earliest start, then longest), else where the longest tail that is a
    proper prefix of a stop string begins: found by searching the whole text for every stop string."""
    found = [(text.find(s), -len(s), s) for s in stops if s and s in text]
    if found:
        start, _, stop = min(found)
        return StopMatch(start, stop)
    held = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return len(text) - held


@pytest.mark.parametrize("seed", range(40))
def test_fed_in_pieces_it_answers_as_a_search_of_the_whole_text(seed):
    rng = random.Random(seed)
    alphabet = "ab" if seed % 2 else "abc"  # small alphabets: stop strings overlap, nest and repeat
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 8))]
    stops += rng.sample(stops, 1) + [""]  # a duplicate and an empty one, both ignored
    matcher = StopStringMatcher(stops)
    text = ""
    while True:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        text += piece
        match = matcher.feed(piece)
        expected = whole_text_answer(text, stops)
        if match is not None or isinstance(expected, StopMatch):
            assert match == expected, (stops, text)
            return
        assert matcher.held_from == expected, (stops, text)


def test_longest_stop_string_at_the_earliest_start_wins():
    matcher = StopStringMatcher(["bcd", "b", "abcde", "abc"])
    assert matcher.feed("xa") is None and matcher.held_from == 1
    assert matcher.feed("bcdefg") == StopMatch(1, "abcde")  # "abc" ends first, "b" and "bcd" start later


def test_without_stop_strings_nothing_is_held():
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") is None and matcher.held_from == 3


def _tiny() -> Tokenizer:
    return Tokenizer.from_gguf(tiny_random_tokenizer_data())


@pytest.mark.parametrize("output", ["random", "a stop string's prefix"])
def test_1000_stop_strings_of_1_kb_over_1000_tokens_cost_well_under_a_second(output):
    # Searching every stop string at every token took 0.8 s for 64 tokens and 12.5 s for 256 here; this costs
    # ~0.05 s. The bound leaves 20x for a loaded machine. Every byte is a token of the tiny tokenizer.
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    stops = ["".join(rng.choice(letters) for _ in range(1024)) for _ in range(1000)]
    if output == "random":
        text = "".join(rng.choice(letters) for _ in range(1000))
    else:  # the whole output may still become a stop string: it is all held back, and searched every token
        text = stops[7][:1000]
    tokenizer = _tiny()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1000
    start = time.perf_counter()
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=stops)
    deltas = [detokenizer.add(token_id) for token_id in ids]
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0
    assert detokenizer.stopped_by is None
    if output == "random":
        assert "".join(deltas) == detokenizer.text and text.startswith(detokenizer.text)
    else:
        assert detokenizer.text == "" and detokenizer.finish() == text


def test_a_stop_string_after_a_long_held_tail_ends_the_text():
    stops = ["x" * 1000 + "!", "x" * 999 + "?"]
    tokenizer = _tiny()
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=stops, include_stop_str_in_output=True)
    deltas = [detokenizer.add(t) for t in tokenizer.encode("ab" + "x" * 1000 + "?!", add_special_tokens=False)]
    assert "".join(deltas) == detokenizer.text == "abx" + "x" * 999 + "?"
    assert detokenizer.stopped_by == "x" * 999 + "?"
