"""A request's stop strings as one Aho-Corasick automaton, so that checking new text costs the
same whatever their number.

The engine's loop thread checks the new text of every running request after every token.
Scanned once per stop string, a request with 10,000 of them made 200 tokens take 10 s instead
of 0.3 s, and every request batched with it waited too (issue 37). Through the automaton a
character costs one transition (amortised), and the checks below read at most the new text
plus the longest stop string's length.
"""

from __future__ import annotations

from collections import deque


class StopStrings:
    """The automaton of one list of stop strings; never changed once built."""

    def __init__(self, stops: list[str]):
        self.stops = list(stops)
        self.longest = max(map(len, self.stops), default=0)
        # A trie of the stop strings; node 0 is the root (the empty string).
        self._children: list[dict[str, int]] = [{}]
        depth, spells = [0], [None]
        for stop in self.stops:
            node = 0
            for ch in stop:
                child = self._children[node].get(ch)
                if child is None:
                    child = len(self._children)
                    self._children[node][ch] = child
                    self._children.append({})
                    depth.append(depth[node] + 1)
                    spells.append(None)
                node = child
            spells[node] = stop
        self._link_suffixes(depth, spells)

    def __deepcopy__(self, memo) -> StopStrings:
        # Never changed once built, so copies of a SamplingParams (EngineLoop.submit deep-copies
        # each request's) share it: copying a long stop list's automaton costs milliseconds
        # (benchmarks/history/RESULTS_LOG.md).
        return self

    def _link_suffixes(self, depth: list[int], spells: list[str | None]) -> None:
        """Per node (breadth first, so a node's fail node, which is shallower, comes before it):
        fail: the node of its longest proper suffix in the trie;
        ends_with: the longest stop string its text ends with (None: none);
        open_end: the length of the longest end of its text that is a proper prefix of some
        stop string, i.e. that a longer text could still complete."""
        n = len(self._children)
        self._fail = [0] * n
        self._ends_with = list(spells)
        self._open_end = [0] * n
        queue = deque(self._children[0].values())
        while queue:
            node = queue.popleft()
            fail = self._fail[node]
            if self._ends_with[node] is None:
                self._ends_with[node] = self._ends_with[fail]
            self._open_end[node] = depth[node] if self._children[node] else self._open_end[fail]
            for ch, child in self._children[node].items():
                self._fail[child] = self._step(fail, ch)
                queue.append(child)

    def _step(self, node: int, ch: str) -> int:
        while node and ch not in self._children[node]:
            node = self._fail[node]
        return self._children[node].get(ch, 0)

    def first_match(self, text: str, start: int) -> tuple[int, str] | None:
        """(where, which) of the stop string occurring first in text[start:]: the earliest start,
        and of two starting there the smaller string (as min() over (index, string) pairs
        orders them); None when none occurs."""
        node, best = 0, None
        for end in range(start, len(text)):
            if best is not None and end + 1 - self.longest > best[0]:
                break               # whatever ends here or later starts after the best
            node = self._step(node, text[end])
            stop = self._ends_with[node]
            if stop is not None:    # the longest stop ending here starts first; the others after it
                hit = (end + 1 - len(stop), stop)
                best = hit if best is None else min(best, hit)
        return best

    def held_back(self, text: str) -> int:
        """The length of the longest end of `text` that is a proper prefix of a stop string (the
        text a stop string completed later would take back)."""
        node = 0
        for ch in text[max(0, len(text) - self.longest + 1):]:
            node = self._step(node, ch)
        return self._open_end[node]
