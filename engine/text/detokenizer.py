"""``IncrementalDetokenizer``: one request's output token ids -> the text deltas a client may see, token by token.

    token id -> decode a small window of recent tokens (prefix/read offsets, as vLLM and TGI do)
             -> hold back bytes that do not form a whole character yet
             -> feed the new text to the request's ``StopStringMatcher`` (stop_strings.py): end at the first stop
                string, hold back a tail that may begin one
             -> the delta the client may see

``tokenizers``' own ``decoders.DecodeStream`` is not used: docs/architecture.md says why.
"""

from __future__ import annotations

from splitserve.engine.text.stop_strings import StopStringMatcher
from splitserve.engine.text.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output: some decoders (sentencepiece's "▁") drop a leading space at the
# start of a decode, so the first output token needs context to keep it.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Streams one request's output text, token by token, and ends it at the first stop string.

    ``add(token_id)`` returns the text that became final with this token. ``text`` is all of it so far.
    Text is held back while (a) its last bytes do not yet form a whole UTF-8 character, or (b) its tail could
    be the beginning of a stop string; ``finish()`` releases what is held when generation ends for another reason.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = StopStringMatcher(stop or [])
        self._include_stop = include_stop_str_in_output
        # The decode window: window[:read_offset] is already text (its decode is prefix_text), the rest is not.
        self._window = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        self.text = ""  # what the caller has been given
        self._held = ""  # whole characters decoded after .text, held back while they may begin a stop string
        self.stopped_by: str | None = None

    def add(self, token_id: int) -> str:
        """Take one output token; return the new final text (possibly empty)."""
        if self.stopped_by is not None:
            return ""
        self._window.append(token_id)
        new_text = self._decode(self._window)
        # A trailing U+FFFD means the window ends inside a character: wait for its remaining bytes.
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""
        new_decoded = new_text[len(self._prefix_text) :]
        self._held += new_decoded
        self._advance_window()
        return self._release(new_decoded)

    def finish(self) -> str:
        """Generation ended (EOS, length, abort): release whatever was held back, including an unfinished
        character (as U+FFFD, as a full decode would show it)."""
        if self.stopped_by is not None:
            return ""
        delta = self._held + self._decode(self._window)[len(self._prefix_text) :]
        self.text += delta
        self._held = ""
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _advance_window(self) -> None:
        """Everything in the window is now text: the unread tokens become the next decode's prefix."""
        self._window = self._window[self._read_offset :]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)

    def _release(self, new_decoded: str) -> str:
        """Hand out held text up to the first stop string, or up to a tail that may start one. Positions count
        from the start of the output; the matcher's never fall before the end of ``.text``, where the held text
        begins, as what it held back last time (all of ``_held``) is where any later match or held tail begins."""
        match = self._stops.feed(new_decoded)
        if match is not None:
            self.stopped_by = match.stop
            end = match.start + (len(match.stop) if self._include_stop else 0)
        else:
            end = self._stops.held_from
        delta = self._held[: end - len(self.text)]
        self.text += delta
        self._held = self._held[len(delta) :]
        return delta
