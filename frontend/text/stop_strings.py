"""Stop strings over streamed text: one KMP automaton per stop string, amortized O(1) work per new character each."""

from __future__ import annotations

from array import array
from functools import lru_cache


@lru_cache(maxsize=8)
def failure_tables(stop: tuple[str, ...]) -> tuple[array, ...]:
    """fail[q] = length of the longest proper border of s[:q] (q = 1..len(s)): where an automaton in state q falls
    back to on a mismatch. Cached so that the n choices of one request, which share the stop list, build it once;
    int32 arrays keep a table for a long stop string small."""
    tables = []
    for s in stop:
        fail = array("i", bytes(4 * (len(s) + 1)))
        k = 0
        for i in range(1, len(s)):
            c = s[i]
            while k and s[k] != c:
                k = fail[k]
            if s[k] == c:
                k += 1
            fail[i + 1] = k
        tables.append(fail)
    return tuple(tables)


class StopStringMatcher:
    """Finds the first stop string completed by text fed piece by piece.

    state[i] is the length of the longest suffix of the text fed so far that is a proper prefix of stop[i], so
    `held` (their maximum) is how much of the text could still turn into the start of a stop string.
    """

    def __init__(self, stop: list[str]) -> None:
        self.stop = tuple(stop)
        self._fail = failure_tables(self.stop)
        self._state = [0] * len(self.stop)
        self.held = 0

    def feed(self, text: str, check: bool = True) -> tuple[int, str] | None:
        """Advances over `text`. With `check`, returns (end, stop string) for the stop string whose match ends first
        in `text` (`end` is the offset just past it), preferring the longer one on a tie. That is the match a client
        fed one character at a time would see first: generation stops as soon as any stop string is complete.
        Without `check` (min_tokens not reached yet), matches are passed over but the states still advance.
        After a match the states are stale: the text ends there."""
        best: tuple[int, str] | None = None
        limit = len(text)
        for i, s in enumerate(self.stop):
            state, end = _advance(s, self._fail[i], self._state[i], text, limit, check)
            self._state[i] = state
            # Only matches ending no later than the best so far can win: the scan of the next ones stops there.
            if end >= 0 and (best is None or (end, -len(s)) < (best[0], -len(best[1]))):
                best, limit = (end, s), end
        if best is None:
            self.held = max(self._state, default=0)
        return best


def _advance(s: str, fail: array, state: int, text: str, limit: int, check: bool) -> tuple[int, int]:
    """Runs the automaton of `s` over text[:limit] from `state`: (new state, end of the first match or -1)."""
    first, n = s[0], len(s)
    i = 0
    while i < limit:
        if state == 0:  # the common case: jump to the next place s could start, in C
            i = text.find(first, i, limit)
            if i < 0:
                return 0, -1
            state = 1
        else:
            c = text[i]
            while state and s[state] != c:
                state = fail[state]
            if s[state] == c:
                state += 1
        i += 1
        if state == n:
            if check:
                return state, i
            state = fail[n]  # a match before min_tokens: keep going as if it were the longest border of s
    return state, -1
