"""Streamed text that adds up to the final text exactly."""

from __future__ import annotations

from collections.abc import Callable, Sequence

INCOMPLETE = "\ufffd"  # what a decoder shows for a character whose bytes have not all arrived


class TextStream:
    """One sample's text, released as its tokens arrive. Each release is a stretch of the full
    decode that later tokens cannot change: a trailing incomplete character waits for its bytes,
    and with stop strings the last (longest stop - 1) characters wait, since a stop string
    completed by later tokens cuts the text before it."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stops: Sequence[str] = ()):
        self._decode = decode
        self._holdback = max(map(len, stops), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = ""

    def add(self, token_ids: Sequence[int]) -> None:
        """Record tokens without releasing text (the last ones: `finish` releases the rest)."""
        self.token_ids.extend(token_ids)

    def push(self, token_ids: Sequence[int]) -> str:
        """The text the new tokens release ("" while it may still change)."""
        self.token_ids.extend(token_ids)
        text = self._decode(self.token_ids)
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
