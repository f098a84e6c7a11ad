"""Stop strings matched on the generated TEXT, across step boundaries.

A speculative step commits several tokens at once, so a stop string can end in the middle of an
accepted block, or be split over two steps. `StopStrings.feed(piece)` takes the text of ONE
token at a time and returns the text that is safe to send: everything except a tail that could
still be the start of a stop string (the hold-back). When a stop string completes, `hit` turns
True and the text before it is all that is ever returned: the stop string itself is not.

    stops = StopStrings(["\\n\\n", "END"])
    out = stops.feed(piece)      # safe text so far ("" while held back)
    if stops.hit: ...            # finish_reason "stop"; stop feeding
    out += stops.flush()         # at the end of the request: release the held-back tail
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # chars a partial match can span
        self.pending = ""  # text received but not yet returned
        self.hit = False

    def feed(self, piece: str) -> str:
        """Text of the next token -> the text that can be sent now."""
        if self.hit or not piece:
            return ""
        if not self.stops:
            return piece
        text = self.pending + piece
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:  # the earliest stop string in the text ends the output before it
            self.hit, self.pending = True, ""
            return text[:cut]
        keep = self._partial_tail(text)
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        for k in range(min(self.hold, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        out, self.pending = ("" if self.hit else self.pending), ""
        return out
