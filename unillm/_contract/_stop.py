"""Stop strings that stay correct while streaming.

A stop string can straddle tokens ("<|e" + "nd|>"), so text that might be the start of one is held
back until the next piece settles it. The stop text itself is never emitted. Only the held-back
tail plus the new piece is searched, so the cost per token does not grow with the output.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher"]


class StopMatcher:
    """Feed text pieces in; get back what is safe to emit, and whether a stop string was hit."""

    __slots__ = ("_held", "_longest", "_stops", "matched", "stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stops)
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the completion

    def strings(self) -> tuple[str, ...]:
        """The stop strings it looks for."""
        return self._stops

    def feed(self, text: str) -> str:
        """Add ``text``; return what can be emitted now. Sets ``stopped`` when a stop string ends
        the completion (the returned text is then everything before it)."""
        buf = self._held + text
        cut, which = -1, None
        for stop in self._stops:
            i = buf.find(stop)
            if i != -1 and (cut == -1 or i < cut):
                cut, which = i, stop
        # A longer stop may still complete from an earlier position ("bc" of "bcc" before the
        # "c" that already matched): then nothing past that position is settled yet.
        hold = self._partial_start(buf, len(buf) if cut == -1 else cut)
        if hold != -1:
            self._held = buf[hold:]
            return buf[:hold]
        self._held = ""
        if cut != -1:
            self.stopped, self.matched = True, which
            return buf[:cut]
        return buf

    def flush(self) -> str:
        """The held-back text, once no more pieces will come."""
        held, self._held = self._held, ""
        return held

    def _partial_start(self, buf: str, before: int) -> int:
        """Earliest index < ``before`` from which the rest of ``buf`` is a proper prefix of a stop
        string (so it may still become one), or -1."""
        for n in range(min(self._longest - 1, len(buf)), 0, -1):
            start = len(buf) - n
            if start >= before:
                break
            tail = buf[start:]
            if any(len(s) > n and s.startswith(tail) for s in self._stops):
                return start
        return -1
