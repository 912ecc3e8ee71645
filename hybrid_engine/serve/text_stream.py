"""The text of one choice as it may be streamed: never a piece of a stop string.

A RequestOutput's `text` is the whole text so far; the engine cuts it where a stop string
begins once the string is complete. Until then the end of the text may be the start of a
stop string, so that end is held back: what has gone out is then always a prefix of the
final text, and a stop string is never half-streamed, whether or not the engine holds such
text back itself.
"""

from __future__ import annotations

from hybrid_engine.stop_strings import StopStrings


class StreamedText:
    def __init__(self, stops: StopStrings):
        self.stops = stops     # the request's automaton (SamplingParams.stop_strings)
        self.sent = 0          # characters already handed out

    def delta(self, text: str, finished: bool) -> str:
        """The characters of `text` (the whole text so far) that can go out now."""
        end = len(text) if finished else len(text) - self.stops.held_back(text)
        if end <= self.sent:
            return ""
        out, self.sent = text[self.sent:end], end
        return out

