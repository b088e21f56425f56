"""``StopStringMatcher``: finds the first stop string in a text that grows at its end, a few characters at a time.

The detokenizer (detokenizer.py) feeds it each piece of new text and learns two things: where the earliest stop
string in the text begins (the longest one, when several begin there), and from where on the text must be held
back because it could still be the beginning of a stop string.

Both come from the same state: the *open starts*, every position p such that text[p:] is a proper prefix of some
stop string. A stop string that ends in new text began at an open start (or inside the new text), so only those
are extended, character by character; a start whose text no longer begins any stop string closes for good. The
earliest open start is where the held-back tail begins. The stop strings are kept sorted, and an open start
carries the range of them that begin with its text: one character narrows the range by two binary searches on
that character. So a new character costs O(log n) per open start (n stop strings), whatever the text's length; a
text usually has one open start or none, and never more than the longest stop string's length, since each is a
proper prefix of one. No automaton is built: the stop strings are only sorted.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from operator import itemgetter
from typing import NamedTuple


class StopMatch(NamedTuple):
    start: int  # where the stop string begins, in the text fed so far
    stop: str


class _OpenStart(NamedTuple):
    start: int
    lo: int  # the sorted stop strings [lo, hi) are those that begin with text[start:]
    hi: int


class StopStringMatcher:
    """``feed(new_text)`` -> the earliest (then longest) stop string ending in ``new_text``, or None;
    ``held_from``: where the tail that may still begin a stop string starts. Done after the first match."""

    def __init__(self, stops: list[str]):
        self._stops = sorted({s for s in stops if s})
        self._open: list[_OpenStart] = []  # by start, ascending
        self._length = 0  # characters fed so far

    @property
    def held_from(self) -> int:
        """Text from here on may still be the beginning of a stop string (the length fed so far when none)."""
        return self._open[0].start if self._open else self._length

    def feed(self, new_text: str) -> StopMatch | None:
        """Extend the text by ``new_text``; the earliest stop string that ends in it (the longest of those that
        begin there), or None."""
        if not self._stops:
            self._length += len(new_text)
            return None
        best: StopMatch | None = None
        for char in new_text:
            self._open.append(_OpenStart(self._length, 0, len(self._stops)))
            self._length += 1
            still_open = []
            for start, lo, hi in self._open:
                depth = self._length - start - 1  # characters of the stop strings already matched
                # Every string in range is longer than depth. Sorted, they share their next character when the
                # first and the last do: then one comparison does, else two binary searches on that character.
                if self._stops[lo][depth] == self._stops[hi - 1][depth]:
                    if char != self._stops[lo][depth]:
                        continue  # closed: no stop string begins with text[start:]
                else:
                    key = itemgetter(depth)
                    lo = bisect_left(self._stops, char, lo, hi, key=key)
                    hi = bisect_right(self._stops, char, lo, hi, key=key)
                    if lo == hi:
                        continue
                if len(self._stops[lo]) == depth + 1:  # the shortest in range is text[start:] itself
                    if best is None or (start, -(depth + 1)) < (best.start, -len(best.stop)):
                        best = StopMatch(start, self._stops[lo])
                    lo += 1  # longer ones from this start may still complete in new_text; all in range stay longer
                if lo < hi:
                    still_open.append(_OpenStart(start, lo, hi))
            self._open = still_open
        return best
