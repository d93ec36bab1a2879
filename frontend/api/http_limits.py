"""HTTP connection limits for uvicorn: a deadline for each request head (slowloris) and a cap on open connections.

uvicorn 0.54 has neither a header timeout nor a body timeout: its keep-alive timer is armed only after a response
and is cancelled by the first byte of the next request, and a fresh connection has no timer at all. So a client
sending a byte every few seconds holds a connection (and a file descriptor) forever. The body timeout lives in an
ASGI middleware; the head has to be timed here, below ASGI, because the app never sees an incomplete head.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from common.config import ServerConfig

log = logging.getLogger("roseinfer.http")


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is not complete `header_timeout` s after it
    opened or after its previous request cycle ended (a 408 first when part of a head arrived; a silent close when
    nothing did, as uvicorn's keep-alive timeout does).

    Relies on these uvicorn 0.54 H11Protocol internals (uvicorn is pinned): the attributes `conn` (its
    h11.Connection), `transport` and `loop`; and that every parsed h11 event goes through `handle_events()`, called
    from `data_received` and, after `conn.start_next_cycle()`, from `on_response_complete` (pipelined requests).
    """

    header_timeout: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        # h11's their_state leaves IDLE once a request head is parsed and is IDLE again once the next cycle starts:
        # only then is the client owing us a head. The timer keeps running across partial heads.
        if self.conn.their_state is not h11.IDLE:
            self._stop_head_timer()
        elif self._head_timer is None and not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        partial, _ = self.conn.trailing_data
        if partial:  # a client mid-head gets told why; an idle one may be racing a new request, so just close
            log.debug("closing %s: no complete request head within %g s", self.client, self.header_timeout)
            self._send_408()
        else:
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()

    def _send_408(self) -> None:
        body = b"Request header timeout"
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"%d" % len(body)),
                   (b"connection", b"close")]  # fmt: skip
        events: list[h11.Event] = [h11.Response(status_code=408, headers=headers, reason=STATUS_PHRASES[408]),
                                   h11.Data(data=body), h11.EndOfMessage()]  # fmt: skip
        with contextlib.suppress(h11.LocalProtocolError):  # h11 will not frame a response now: the caller just closes
            self.transport.write(b"".join(self.conn.send(e) or b"" for e in events))


def header_timeout_protocol(header_timeout: float) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...); a timeout <= 0 means none (plain H11Protocol)."""
    if header_timeout <= 0:
        return H11Protocol

    class _Protocol(HeaderTimeoutProtocol):
        pass

    _Protocol.header_timeout = header_timeout
    return _Protocol


def uvicorn_limits(config: ServerConfig) -> dict[str, Any]:
    """uvicorn.Config kwargs for --header-timeout and --max-connections."""
    # uvicorn answers 503 once len(open connections) >= limit_concurrency, counting the asking one: + 1 serves
    # exactly max_connections. The h11 protocol is also what "auto" picks here (httptools is not installed).
    return {"http": header_timeout_protocol(config.header_timeout), "limit_concurrency": config.max_connections + 1}
