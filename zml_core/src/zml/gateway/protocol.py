"""The gateway's HTTP/1.1 connections: uvicorn's h11 protocol, with a bound on the request head.

uvicorn bounds neither how long a request's head (request line and headers) may take to
arrive nor, with httptools (what ``http="auto"`` picks when it is installed), how large it may
grow: a client that connects and sends nothing, or one header byte now and then, holds its
connection open for ever, and one that sends megabytes of header is buffered whole. Its
``timeout_keep_alive`` only runs between a response and the next byte. So the gateway runs
uvicorn's h11 protocol, whose head is bounded by ``h11_max_incomplete_event_size`` (a larger
head gets 431), and this subclass adds the time limit:

* while no request is being served (from the connection's opening, and from the end of each
  response), a timer runs; when a request's head has arrived in full it stops, and the
  request's body then has its own limit (``[gateway] body_timeout_s``);
* if it fires first, the connection is closed: with a 408 when part of a head had arrived,
  without a word when nothing had (an idle connection, or the unread rest of a body).

Nor does uvicorn bound how long a response may wait on a client that stops reading: once the
connection's write buffer is full, the app's ``send`` waits for ever, and with it the request
(a stream's node slot included). So a second timer runs while writing is paused (the client
reads nothing and the buffer stays above its high-water mark); when it reaches
``[gateway] send_timeout_s`` the connection is aborted. The app then sees the client gone, as
for any disconnect: the request is cancelled and its slot freed.
"""

from __future__ import annotations

import asyncio
import http
import logging
from typing import Any

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE  # as uvicorn's h11_impl does
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from .errors import error_reply

__all__ = ["MAX_HEAD_BYTES", "GatewayH11Protocol"]

logger: logging.Logger = logging.getLogger("zml.gateway")

MAX_HEAD_BYTES = 64 * 1024
"""The largest request head (request line and headers) read; a larger one gets 431 (the
check is made every :data:`_PIECE` bytes, so a head of up to that much more may pass)."""

_PIECE = 1024
"""While a head is awaited, h11 is fed at most this many bytes at a time."""


class GatewayH11Protocol(H11Protocol):
    """uvicorn's h11 protocol whose connections close when a request head is late (408).

    It also aborts a connection whose client has read nothing of its response for
    ``send_timeout_s`` while the write buffer was full.

    uvicorn makes one per connection with its config and state; ``head_timeout_s`` and
    ``send_timeout_s`` are bound with :func:`functools.partial` (which, unlike a class made on
    the fly, can be pickled for the worker processes of ``zml serve --workers N``).
    """

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *,
                 head_timeout_s: float, send_timeout_s: float = 60.0) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.head_timeout_s = head_timeout_s
        self.send_timeout_s = send_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._upgraded = False

    # The timer runs exactly while no request is being served.

    def _serving(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _follow_state(self) -> None:
        if self._serving() or self._upgraded:
            self._stop_head_timer()
        elif self._head_timer is None and not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._serving() or self.transport.is_closing():
            return  # pragma: no cover - the timer is stopped first
        partial = (self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE
                   and self.conn.trailing_data[0].strip() != b"")
        if partial:
            logger.warning("zml gateway: a request head did not arrive within %g s "
                           "([gateway] head_timeout_s); connection closed with 408",
                           self.head_timeout_s)
            self._write_error(408, error_reply(
                408, f"the request's headers did not arrive within {self.head_timeout_s:g} s "
                "([gateway] head_timeout_s)", "invalid_request_error",
                code="request_timeout").body())
        self.transport.close()

    def _write_error(self, status: int, body: bytes) -> None:
        """An error response written as is (h11 sends none before a whole request head)."""
        head = [b"HTTP/1.1 %d %s\r\n" % (status, http.HTTPStatus(status).phrase.encode())]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n",
                 b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)

    # uvicorn's hooks

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._follow_state()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._stop_send_timer()
        super().connection_lost(exc)

    # The send timer runs exactly while writing is paused (the client is not reading).

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None and not self.transport.is_closing():
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._send_timed_out)

    def resume_writing(self) -> None:
        self._stop_send_timer()
        super().resume_writing()

    def _stop_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_timed_out(self) -> None:
        self._send_timer = None
        logger.warning("zml gateway: a client read nothing of its response for %g s "
                       "([gateway] send_timeout_s); connection closed, its request cancelled",
                       self.send_timeout_s)
        self.transport.abort()  # close() would wait for the unread buffer to drain

    def data_received(self, data: bytes) -> None:
        # h11 measures a head only while it is incomplete: a whole head in one read (up to
        # 256 KiB) would pass whatever its size. Fed in pieces, it is measured every piece.
        start = 0
        while (len(data) - start > _PIECE and self.conn.their_state is h11.IDLE
               and not self._upgraded and not self.transport.is_closing()):
            super().data_received(data[start:start + _PIECE])
            start += _PIECE
        if start < len(data) and not self._upgraded and not self.transport.is_closing():
            super().data_received(data[start:] if start else data)
        self._follow_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_state()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._upgraded = True  # the connection is the WebSocket protocol's from here
        self._stop_head_timer()
        super().handle_websocket_upgrade(event)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 refused, as an OpenAI-shaped error: 431 when its
        head was too large, else 400 (uvicorn's own is plain text). When a response had already
        begun (a malformed chunk of a body read after it), the connection is only closed."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.close()
            return
        limit = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        if len(self.conn.trailing_data[0]) > limit:
            self._write_error(431, error_reply(
                431, f"the request's line and headers are larger than {limit} bytes",
                "invalid_request_error",
                code="request_header_fields_too_large").body())
        else:
            self._write_error(400, error_reply(
                400, "the request is not valid HTTP/1.1 (a malformed request line, header, "
                "Content-Length or chunk, or no Host header): send a well-formed request, as "
                "any HTTP client library does", "invalid_request_error",
                code="invalid_http_request").body())
        self.transport.close()
