"""Streamed text that adds up to the final text exactly."""

from __future__ import annotations

from collections.abc import Callable, Sequence

INCOMPLETE = "\ufffd"  # what a decoder shows for a character whose bytes have not all arrived


class TextStream:
    """One sample's text, released as its tokens arrive. Each release is a stretch of the full
    decode that later tokens cannot change: a trailing incomplete character waits for its bytes,
    and with stop strings the last (longest stop - 1) characters wait, since a stop string
    completed by later tokens cuts the text before it.

    Each push decodes only the tokens of the last two pushes, not all of them (a whole decode per
    push costs O(length), 0.5 ms at 2,048 tokens): the text up to the push before is settled, and
    the window starts one push earlier, so that what the decoder joins across the cut (a space
    cleanup, a leading-space rule) is decoded as the whole decode does."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()):
        self._decode = decode
        self._holdback = max(map(len, stops), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = ""
        self._settled = ""  # decode of token_ids[:_upto]
        self._from = self._upto = 0  # the window's start; the settled tokens' end
        self._head = ""  # decode of token_ids[_from:_upto] alone

    def add(self, token_ids: Sequence[int]) -> None:
        """Record tokens without releasing text (the last ones: `finish` releases the rest)."""
        self.token_ids.extend(token_ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """The text the new tokens release ("" while it may still change)."""
        self.token_ids.extend(token_ids)
        text = self._text()
        self._settle(text)
        stable = text[:len(text) - self._holdback].rstrip(INCOMPLETE)
        if len(stable) <= len(self.sent) or not stable.startswith(self.sent):
            return ""
        delta, self.sent = stable[len(self.sent):], stable
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the final text (its start was released already)."""
        delta = final_text[len(self.sent):] if final_text.startswith(self.sent) else ""
        self.sent = final_text
        return delta

    def _text(self) -> str:
        """The decode of every token so far; the whole decode where the window's disagrees with
        the settled text."""
        window = self._decode(self.token_ids[self._from:])
        if not window.startswith(self._head):
            return self._decode(self.token_ids)
        return self._settled + window[len(self._head):]

    def _settle(self, text: str) -> None:
        """Settle `text` (all tokens) when it ends on a whole character; the window then starts
        at the previous settled end."""
        if text.endswith(INCOMPLETE):
            return
        self._from, self._upto = self._upto, len(self.token_ids)
        self._head = self._decode(self.token_ids[self._from:self._upto])
        self._settled = text
