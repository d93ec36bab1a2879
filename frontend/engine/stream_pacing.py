"""StreamPacing: how many tokens a stream gathers before its consumer is woken, by the number of streams in flight.

Every wakeup of a streaming consumer is an SSE event: a JSON chunk and a socket write here, a read and a JSON parse in
the client. With many streams those per-event costs take CPU from the engine (on a small CPU host the client and this
process run beside the engine's threads; on a GPU host this process becomes the bottleneck). Up to
`per_token_streams` streams every token goes out at once. Above, a stream wakes its consumer once
ceil(streams / per_token_streams) tokens wait, so the events per engine step stay about what `per_token_streams`
streams send; and no token waits more than `max_hold_s`: tokens are held only while the next one, at the stream's last
gap between tokens, is due before that (slow steps on a busy machine send every token at once), and a timer wakes the
consumer of a stream whose next token is late (preempted, a long prefill step). A stream's first output and its end
always go at once.
"""

from __future__ import annotations

from collections.abc import Callable

PER_TOKEN_STREAMS = 16
MAX_TOKENS_PER_WAKEUP = 16
MAX_HOLD_S = 0.5


class StreamPacing:
    def __init__(self, num_streams: Callable[[], int], per_token_streams: int = PER_TOKEN_STREAMS,
                 max_tokens: int = MAX_TOKENS_PER_WAKEUP, max_hold_s: float = MAX_HOLD_S) -> None:  # fmt: skip
        self.num_streams = num_streams
        self.per_token_streams = max(1, per_token_streams)
        self.max_tokens = max(1, max_tokens)
        self.max_hold_s = max_hold_s

    def tokens_per_wakeup(self) -> int:
        """1 (every token at once) up to per_token_streams streams; then one more per further per_token_streams."""
        n = self.num_streams()
        if n <= self.per_token_streams:
            return 1
        return min(self.max_tokens, -(-n // self.per_token_streams))
