"""Deadlines and a connection limit for ``ragfix serve``: what uvicorn's HTTP/1.1 protocol does
not bound.

uvicorn (h11) closes only an idle kept-alive connection (``timeout_keep_alive``, counted from an
answer and stopped by any byte received) and counts ``limit_concurrency`` only once a request's
head is complete. A client that connects and sends nothing, or sends its head or its body a byte
at a time, therefore holds its connection, and a file descriptor, as long as it likes; about a
thousand of them exhaust the open files of the process (1024 by default on Linux) and no other
client can connect (issue 45: 1150 trickling connections stopped the server, with an API key
set, since a key is read from a complete head only).

:class:`GuardedH11Protocol` is uvicorn's h11 protocol with the bounds of :class:`ServeLimits`:

* head deadline: a request's head (request line and headers) is complete within
  ``header_timeout_s`` of the connection, or of the previous answer on a kept-alive connection;
* body deadline: its body is complete within ``body_timeout_s`` of its head, whatever the route
  does with it (a 401 that never reads the body included);
* connection limit: a connection made while ``max_connections`` are open, or while its
  address holds ``max_connections_per_client`` of them, is answered 503
  ``too_many_connections`` and closed at once, before anything of it is read: one client
  cannot take every connection;
* write deadline: an answer the client stops reading (the transport's buffer stays full, so
  asyncio has paused writing) for ``write_timeout_s`` has its connection closed, as one that
  stops writing is.

A request that misses a deadline is answered 408 ``request_timeout`` (when no answer to it has
started), in OpenAI's error format with ``Connection: close``, and its connection is closed; its
application task sees the client gone. A connection that sent nothing since it was made or
answered is closed without an answer, as uvicorn's keep-alive timeout closes one.
"""

from __future__ import annotations

import ipaddress
import json
import re

import h11
from pydantic import BaseModel, ConfigDict, Field, field_validator
from uvicorn.protocols.http.h11_impl import H11Protocol

from ragfix.serve_errors import ApiError

#: how long a client may take to send a request's head (request line and headers), from when it
#: connected or was sent its previous answer (seconds): clients send a head of a few hundred
#: bytes in one write (the openai client's and httpx's were complete at most 2.1 ms after they
#: connected on loopback, measured for issue 45); 10 s also covers a head lost and resent three
#: times over a bad network (TCP resends after 1, 2 and 4 s)
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: how long a client may take to send a request's body once its head is in (seconds): the
#: largest body accepted (:data:`~ragfix.serve.DEFAULT_MAX_BODY_BYTES`, 4 MiB) took at most
#: 11 ms on loopback (the openai client and httpx, measured for issue 45); 60 s lets it come
#: over 0.6 Mbit/s
DEFAULT_BODY_TIMEOUT_S = 60.0
#: most connections open at once; one more is answered 503 and closed before it is read. Each
#: holds a file descriptor (the server itself holds 7 serving SmolLM2, measured) and up to one
#: body (:data:`~ragfix.serve.DEFAULT_MAX_BODY_BYTES`): 256 stays well within Linux's default
#: of 1024 open files and bounds the bodies held to 1 GiB, and it is 64 times the requests
#: ragfix's own client keeps in flight (``--concurrency`` 4)
DEFAULT_MAX_CONNECTIONS = 256
#: most of those connections one client address may hold: an eighth, so that clients that hold
#: connections without reading their answers take at most an eighth of the server each; 32 is
#: eight times the requests ragfix's own client keeps in flight
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 32
#: how long an answer may wait for a client that does not read it (seconds, while asyncio has
#: paused writing because the transport's buffer is full)
DEFAULT_WRITE_TIMEOUT_S = 30.0
#: how long a connection is kept open for a next request after an answer (seconds; uvicorn's
#: ``timeout_keep_alive`` default)
DEFAULT_KEEP_ALIVE_S = 5.0
#: largest request head (bytes; h11's default ``max_incomplete_event_size``): a longer one is
#: refused (400) as it arrives
MAX_HEADER_BYTES = 16 * 1024
#: open files the server keeps for itself beyond one per connection (it holds 7 at rest; the
#: rest is headroom for the files a request or a library may open)
OPEN_FILES_RESERVE = 64
#: most connections accepted in one go (the listen backlog, which asyncio also takes as its
#: accept batch; uvicorn's 2048 let 1150 clients connecting at once use up 1024 open files
#: before the ones over the limit were closed). A few batches are accepted before the first
#: is closed: 1150 clients connecting at once under the default limits held at most 476 open
#: files with batches of 128, 775 with batches of 256 (measured for issue 45)
ACCEPT_BURST = 128

#: host names every server answers to, with its port: the loopback addresses and ``localhost``
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
#: one ``--allowed-hosts`` name: ``*``, or a host name, IPv4 or bracketed IPv6 address, with or
#: without ``:PORT``
_HOST_NAME = re.compile(r"(\*|(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)(:[0-9]{1,5})?)")

#: reason phrases of the answers the protocol writes itself
_PHRASES = {408: "Request Timeout", 503: "Service Unavailable"}


def error_bytes(error: ApiError) -> bytes:
    """A whole HTTP/1.1 answer carrying ``error`` in OpenAI's format, with ``Connection:
    close``."""
    body = json.dumps(error.body()).encode()
    head = (
        f"HTTP/1.1 {error.status} {_PHRASES[error.status]}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


class ServeLimits(BaseModel):
    """How long a client may take to send a request, how many may be connected and which host
    names it may ask for (``ragfix serve --header-timeout --body-timeout --keep-alive-timeout
    --max-connections --allowed-hosts``; frozen, validated when built, unknown fields refused).
    A request that misses a deadline is answered 408 ``request_timeout`` and its connection
    closed; a connection beyond the limit is answered 503 ``too_many_connections`` and closed
    before it is read (:class:`GuardedH11Protocol`); a request for another host is answered 403
    (:class:`HostGate`).

    Attributes:
        header_timeout_s: a request's head must be complete this long after the connection was
            made, or after the previous answer on a kept-alive connection.
        body_timeout_s: its body must be complete this long after its head.
        keep_alive_s: an idle connection is closed this long after its last answer.
        max_connections: most connections open at once.
        max_connections_per_client: most of them one client address may hold.
        write_timeout_s: an answer the client has not read for this long (asyncio's writing
            paused) has its connection closed.
        max_header_bytes: largest request head (a longer one is 400).
        allowed_hosts: ``Host`` header names answered beside the server's own
            (:data:`LOOPBACK_HOSTS` and the bound address, with the port; :class:`HostGate`):
            ``name`` (any port) or ``name:port``, ``*`` for any; a comma-separated string is
            split. Names are compared without case.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    header_timeout_s: float = Field(default=DEFAULT_HEADER_TIMEOUT_S, gt=0)
    body_timeout_s: float = Field(default=DEFAULT_BODY_TIMEOUT_S, gt=0)
    keep_alive_s: float = Field(default=DEFAULT_KEEP_ALIVE_S, gt=0)
    max_connections: int = Field(default=DEFAULT_MAX_CONNECTIONS, ge=1)
    max_connections_per_client: int = Field(default=DEFAULT_MAX_CONNECTIONS_PER_CLIENT, ge=1)
    write_timeout_s: float = Field(default=DEFAULT_WRITE_TIMEOUT_S, gt=0)
    max_header_bytes: int = Field(default=MAX_HEADER_BYTES, ge=1024)
    allowed_hosts: tuple[str, ...] = ()

    @field_validator("allowed_hosts", mode="before")
    @classmethod
    def _split_hosts(cls, value):
        """A comma-separated string (``--allowed-hosts a.lan,b.lan:8000``) as its names, each
        checked (:data:`_HOST_NAME`) and lower-cased.

        Raises:
            ValueError: an empty list item or a name that is not a host (a scheme, a path).
        """
        if isinstance(value, str):
            value = value.split(",") if value.strip() else []
        names = value
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ValueError("expected host names (a comma-separated string or a list)")
        out = []
        for name in names:
            name = name.strip()
            if not _HOST_NAME.fullmatch(name):
                raise ValueError(
                    f"{name!r} is not a host name (expected NAME, NAME:PORT, [IPv6]:PORT or *)"
                )
            out.append(name.lower())
        return tuple(out)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head deadline, a body deadline and a connection limit (see
    the module docstring). Built by uvicorn per connection, ``limits`` bound with
    ``functools.partial`` (:func:`server_config`).

    One timer runs per connection, for the phase the client is in: ``"head"`` while h11 waits
    for a request (``their_state`` IDLE), ``"body"`` while it reads one (SEND_BODY), none while
    the request is complete and being answered (the model may take its time).
    """

    def __init__(self, *args, limits: ServeLimits, **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._phase: str | None = None
        self._timer = None
        self._stalled = None  # the write deadline, while asyncio has paused writing
        self._refused = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else None
        mine = sum(1 for c in self.connections if c.client and c.client[0] == host)
        full = None
        if len(self.connections) > self.limits.max_connections:
            full = f"the server holds its most connections ({self.limits.max_connections}, "
            full += "ragfix serve --max-connections)"
        elif host is not None and mine > self.limits.max_connections_per_client:
            full = "this client address holds its most connections ("
            full += f"{self.limits.max_connections_per_client}, ragfix serve "
            full += "--max-connections-per-client)"
        if full:
            self._refused = True
            self._answer_and_close(
                ApiError(503, f"{full}; try again shortly", code="too_many_connections")
            )
            return
        self._watch()

    def pause_writing(self) -> None:
        """The client is not reading: its answer may wait ``write_timeout_s`` for it."""
        super().pause_writing()
        self._stalled = self.loop.call_later(self.limits.write_timeout_s, self._stalled_out)

    def _stalled_out(self) -> None:
        """The client did not read its answer for ``write_timeout_s``: drop the connection
        (``abort``: ``close`` would wait for the unread buffer); the application task sees the
        client gone."""
        self._stalled = None
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.abort()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self._stalled is not None:
            self._stalled.cancel()
        super().connection_lost(exc)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _watch(self) -> None:
        """(Re)arm the deadline of the phase the client is in, when it has changed."""
        if self.transport.is_closing():
            self._cancel()
            return
        state = self.conn.their_state
        phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._phase:
            return
        self._cancel()
        self._phase = phase
        if phase is not None:
            limit = self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s
            self._timer = self.loop.call_later(limit, self._expired, phase)

    def _expired(self, phase: str) -> None:
        """The deadline of ``phase`` is over: answer 408 and close (silently for a connection
        that sent nothing of a next request, or whose request is being answered already)."""
        self._timer = None
        if self.transport.is_closing() or phase != self._phase:
            return
        if phase == "head":
            waiting = bool(self.conn.trailing_data[0])  # part of a head came
            what = f"its head within {self.limits.header_timeout_s:g} s"
            flag = "--header-timeout"
        else:
            waiting = self.cycle is not None and not self.cycle.response_started
            what = f"its body within {self.limits.body_timeout_s:g} s of its head"
            flag = "--body-timeout"
        if not waiting:
            self.transport.close()
            return
        self._answer_and_close(
            ApiError(
                408,
                f"the request did not send {what} (ragfix serve {flag})",
                code="request_timeout",
            )
        )

    def _answer_and_close(self, error: ApiError) -> None:
        """Write ``error`` as the whole answer and close; the application task of an unanswered
        request sees the client gone (its sends are dropped)."""
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.write(error_bytes(error))
        self.transport.close()


class HostGate:
    """ASGI middleware: a request whose ``Host`` header is not one the server answers to is
    refused 403 ``host_not_allowed`` in OpenAI's error format before the application sees it.

    The server answers to :data:`LOOPBACK_HOSTS`, the bound ``host`` (unless a wildcard address,
    ``0.0.0.0`` or ``::``) and the local address the connection came to (``scope["server"]``),
    each with the connection's port (without it for port 80), and to ``allowed_hosts``
    (:attr:`ServeLimits.allowed_hosts`). A request without a ``Host`` header is refused too.

    Args:
        app: the ASGI application.
        host: the address the server is bound to (``ragfix serve --host``).
        allowed_hosts: names answered beside those (``*``: any).
    """

    def __init__(self, app, host: str, allowed_hosts: tuple[str, ...] = ()):
        self.app, self.allowed = app, set(allowed_hosts)
        self.own = {*LOOPBACK_HOSTS}
        if host not in ("0.0.0.0", "::", ""):
            self.own.add(_bracketed(host).lower())

    def answers(self, given: str, local: tuple[str, int] | None) -> bool:
        """Whether a request with ``Host: given`` that came to ``local`` (address, port) is
        answered."""
        if "*" in self.allowed:
            return True
        given = given.strip().lower()
        name, _, port = given.rpartition(":") if not given.endswith("]") else (given, "", "")
        if not name or not port.isdigit():
            name, port = given, "80"
        if name in self.allowed or given in self.allowed:
            return True
        own = self.own | ({_bracketed(local[0]).lower()} if local else set())
        return name in own and (local is None or int(port) == local[1])

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            if not self.answers(given, scope.get("server")):
                from fastapi.responses import JSONResponse

                refusal = ApiError(
                    403,
                    f"this server does not answer to Host {given!r} (ragfix serve "
                    "--allowed-hosts names the host names it answers to besides its own address)",
                    code="host_not_allowed",
                )
                await JSONResponse(refusal.body(), status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _bracketed(address: str) -> str:
    """An address as a ``Host`` header writes it: an IPv6 address in brackets."""
    try:
        return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    except ValueError:
        return address


def server_config(
    app, host: str, port: int, limits: ServeLimits | None = None, log_level: str = "warning"
):
    """The uvicorn configuration ``ragfix serve`` runs ``app`` with: ``app`` behind the ``Host``
    check of ``host`` and ``limits.allowed_hosts`` (:class:`HostGate`), uvicorn's h11 protocol
    with the head and body deadlines and the connection limit of ``limits``
    (:class:`GuardedH11Protocol`), uvicorn's keep-alive timeout
    (``timeout_keep_alive``) and head size limit (``h11_max_incomplete_event_size``) from them,
    and a listen ``backlog`` of :func:`accept_burst` (asyncio accepts that many connections at
    once before any is answered: with uvicorn's 2048, a burst of clients used up 1024 open files
    before the connections over the limit could be closed).

    Args:
        app: the ASGI application (:func:`create_app`).
        host, port: where to listen.
        limits: the deadlines and limits (default: :class:`ServeLimits`'s defaults).
        log_level: uvicorn's log level.

    Returns:
        a ``uvicorn.Config`` (run it with ``uvicorn.Server(config).run()``).
    """
    import functools

    import uvicorn

    limits = limits or ServeLimits()
    return uvicorn.Config(
        HostGate(app, host, limits.allowed_hosts),
        host=host,
        port=port,
        log_level=log_level,
        http=functools.partial(GuardedH11Protocol, limits=limits),
        timeout_keep_alive=limits.keep_alive_s,
        h11_max_incomplete_event_size=limits.max_header_bytes,
        backlog=accept_burst(limits),
    )


def accept_burst(limits: ServeLimits) -> int:
    """The listen backlog :func:`server_config` sets, which asyncio also takes as the most
    connections it accepts in one go, before any of them is answered: ``max_connections``, at
    most :data:`ACCEPT_BURST`."""
    return min(limits.max_connections, ACCEPT_BURST)


def reserve_open_files(limits: ServeLimits) -> int:
    """Make sure this process may open a file per connection it may hold at once (the
    ``max_connections`` open ones and three batches of :func:`accept_burst` more, accepted
    before those over the limit are closed) plus :data:`OPEN_FILES_RESERVE`: the soft limit on open
    files (``ulimit -n``) is raised towards the hard one when it is lower (where the system has
    such limits).

    Returns:
        the soft limit on open files now (``-1``: unlimited, or a system without limits).

    Raises:
        ConfigError: the hard limit is lower (the message names ``--max-connections`` and the
            most the limit allows).
    """
    try:
        import resource
    except ImportError:  # not a Unix system
        return -1
    need = limits.max_connections + 3 * accept_burst(limits) + OPEN_FILES_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft
    if hard != resource.RLIM_INFINITY and hard < need:
        from ragfix.errors import ConfigError

        raise ConfigError(
            f"--max-connections {limits.max_connections} needs {need} open files and this "
            f"process may open {hard} (ulimit -Hn): give --max-connections "
            f"{max((hard - OPEN_FILES_RESERVE) // 4, 1)} or less, or raise the limit"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return need


__all__ = [
    "ACCEPT_BURST",
    "DEFAULT_BODY_TIMEOUT_S",
    "DEFAULT_HEADER_TIMEOUT_S",
    "DEFAULT_KEEP_ALIVE_S",
    "DEFAULT_MAX_CONNECTIONS",
    "MAX_HEADER_BYTES",
    "OPEN_FILES_RESERVE",
    "LOOPBACK_HOSTS",
    "GuardedH11Protocol",
    "HostGate",
    "ServeLimits",
    "accept_burst",
    "error_bytes",
    "reserve_open_files",
    "server_config",
]
