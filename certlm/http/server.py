"""Running the app under hypercorn, over HTTPS when a TLS server certificate has been installed."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import signal
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config
from hypercorn.typing import (
    ASGIFramework,
    ASGIReceiveCallable,
    ASGIReceiveEvent,
    ASGISendCallable,
    ASGISendEvent,
    Scope,
)

from certlm.foundation.config import Settings
from certlm.foundation.logs import FILE_ONLY
from certlm.http.app import create_app
from certlm.service.host import Host
from certlm.storage import close_storage, open_storage
from certlm.storage.migrations import DatabaseNewerThanCode, PluginMigrationFailed
from certlm.system.tls import ServerTls, prepare_server_tls, server_ssl_context

# CPython collects its young generation once 700 more objects it tracks have been made than freed; certlm's work
# makes and keeps many for a while (a monitor visit's client, parsed messages and rows, alive across its awaits), so
# at 700 the collector ran about 80 times in a scan of 300 devices, promoting what the visits in flight still held
# until a full collection walked it all: 80-250 ms of the scan's 3 s of CPU, one full collection holding the event
# loop 115-150 ms (bench/profile_monitor.py, 300 devices, timed with gc.callbacks). At 5,000 the young collections
# are ten times fewer, each at most a few milliseconds, and the older generations fill that much more slowly.
COLLECTOR_THRESHOLDS = (5000, 10, 10)
log = logging.getLogger(__name__)


class CertlmConfig(Config):
    """hypercorn's settings, serving TLS under certlm's policy (``certlm.system.tls``) instead of hypercorn's."""

    def create_ssl_context(self) -> ssl.SSLContext | None:
        if not self.ssl_enabled:
            return None
        return server_ssl_context(self.certfile, self.keyfile, self.keyfile_password, self.alpn_protocols)


# After the drain (``Settings.shutdown_grace_s``), how long hypercorn waits for the connections before cancelling them.
SHUTDOWN_CANCEL_AFTER_S = 3.0
# How long an answer that closes the connection waits for the rest of the request body before closing.
UNREAD_BODY_LINGER_S = 5.0


class CloseAfterUnreadBody:
    """ASGI middleware: an HTTP/1 answer that starts before the request body has arrived in full says
    ``Connection: close``. That is every early answer to an upload: 413 for a body over ``MAX_CONTENT_LENGTH``
    (chunked or not), 401 or 403 before it is read.

    hypercorn closes such a connection once the answer is sent, since the rest of the body was never read, but
    without the header a client puts the connection back into its pool and sends its next request into the
    closing socket, where it fails. With it, h11 frames the answer as the connection's last and the client opens
    a new connection. HTTP/2 ends just the stream, and forbids the header.

    The answer's end is held back until the client has sent the rest of its body (read and dropped), at most
    ``UNREAD_BODY_LINGER_S``: a socket closed with unread data is reset, and a client still sending its upload
    then loses the answer it had not read yet.
    """

    def __init__(self, app: ASGIFramework, linger_s: float = UNREAD_BODY_LINGER_S) -> None:
        self.app = app
        self.linger_s = linger_s

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http" or scope["http_version"] not in ("1.0", "1.1"):
            await self.app(scope, receive, send)
            return
        request_over = asyncio.Event()
        closing = False

        async def receive_noting_the_end() -> ASGIReceiveEvent:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                request_over.set()
            return message

        async def send_closing_early(message: ASGISendEvent) -> None:
            nonlocal closing
            if message["type"] == "http.response.start" and not request_over.is_set():
                closing = True
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            elif closing and message["type"] == "http.response.body" and not message.get("more_body", False):
                # The app's receiver is still reading (and Quart dropping) the body while this waits.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(request_over.wait(), self.linger_s)
            await send(message)

        await self.app(scope, receive_noting_the_end, send_closing_early)


class Drain:
    """ASGI middleware for a clean stop: counts the HTTP requests in flight, and once ``drain`` has begun answers
    every new one 503 while those finish (a push runs inside its request, so the pushes in flight are among them)."""

    def __init__(self, app: ASGIFramework) -> None:
        self.app = app
        self.in_flight = 0
        self._tasks: set[asyncio.Task] = set()
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._abandon = asyncio.Event()

    async def __call__(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            await _refuse_while_draining(send)
            return
        self.in_flight += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def note_handler(self) -> None:
        """A ``before_request`` hook: Quart runs each request's handler in a task of its own, which a cancelled
        request leaves running; ``cancel_in_flight`` cancels and waits for these."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def drain(self, grace_s: float) -> bool:
        """Refuse new requests and wait for those in flight, at most ``grace_s`` (or until ``abandon``); whether
        every one finished."""
        self.draining = True
        waiting = asyncio.ensure_future(self._idle.wait())
        abandoned = asyncio.ensure_future(self._abandon.wait())
        try:
            await asyncio.wait({waiting, abandoned}, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
            abandoned.cancel()
        return self._idle.is_set()

    async def cancel_in_flight(self, timeout: float) -> None:
        """Cancel the requests still in flight and wait, at most ``timeout``, for their clean-up (a push releases its
        device's lease, an operation record is written or rolled back) while storage is still open."""
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def abandon(self) -> None:
        """Stop waiting for the requests in flight (a second SIGTERM or Ctrl-C)."""
        self._abandon.set()


DRAINING_ERROR = (
    "certlm is stopping: it finishes the operations in flight and starts no new ones; retry once it is back, or on "
    "another instance"
)


async def _refuse_while_draining(send: ASGISendCallable) -> None:
    body = json.dumps({"error": DRAINING_ERROR}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 503, "headers": [*headers, (b"retry-after", b"30")]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def listening_socket(host: str, port: int, backlog: int = Config.backlog) -> socket.socket:
    """A TCP socket listening on ``host:port``, made before the app starts: a port in use stops start-up at once with
    a message instead of a traceback after it, and "Running on" is true from the moment it is said."""
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        listener.bind((host, port))
        listener.listen(backlog)
    except OSError as error:
        listener.close()
        raise SystemExit(f"certlm: cannot listen on {host}:{port}: {error.strerror or error}") from None
    return listener


def hypercorn_config(listener: socket.socket, tls: ServerTls | None = None) -> Config:
    """Serve on ``listener`` (hypercorn takes the socket over), with TLS when ``tls`` is given.

    hypercorn logs to the ``hypercorn.error`` logger and certlm's handlers, not to a stream of its own, and without
    its INFO lines: they only repeat the address certlm announces once the app has started.
    """
    config = CertlmConfig()
    config.bind = [f"fd://{listener.detach()}"]
    config.accesslog = None
    errors = logging.getLogger("hypercorn.error")
    errors.setLevel(logging.WARNING)
    config.errorlog = errors
    # certlm drains the requests in flight itself (``Drain``) before hypercorn stops; this bounds what remains.
    config.graceful_timeout = SHUTDOWN_CANCEL_AFTER_S
    if tls is not None:
        config.certfile = str(tls.files.cert_file)
        config.keyfile = str(tls.files.key_file)
        config.keyfile_password = tls.key_password
    return config


async def activate_server_tls(settings: Settings, certlm_host: Host) -> ServerTls | None:
    """Settle the TLS certificate before hypercorn binds, which needs it before the app's own start-up.

    Storage is opened (and so created or migrated, the plugins' tables and steps included) and closed again; the app
    opens it afresh in ``before_serving``. A migration that fails stops start-up here with its message, before
    anything listens.
    """
    try:
        await open_storage(settings.database_url, certlm_host.model_modules, certlm_host.plugin_migrations)
    except (PluginMigrationFailed, DatabaseNewerThanCode) as error:
        await close_storage()
        raise SystemExit(f"certlm: {error}") from None
    try:
        return await prepare_server_tls(settings.data_dir, certlm_host.secrets)
    finally:
        await close_storage()


async def serve(
    settings: Settings, host: str, port: int, after_start: Callable[[str], Awaitable[None]] | None = None
) -> None:
    """Serve until SIGINT or SIGTERM. Once the app has started, "Running on" is logged and ``after_start`` runs as a
    background task, given the service's base URL.

    The signal starts a drain: new requests are answered 503 while those in flight (pushes among them) get
    ``settings.shutdown_grace_s`` to finish; what is still running then (or at a second signal) is cancelled, its
    clean-up given ``SHUTDOWN_CANCEL_AFTER_S``. Then the schedulers stop and storage closes (``create_app``)."""
    listener = listening_socket(host, port)
    app = create_app(settings)
    certlm_host: Host = app.extensions["certlm"]
    config = hypercorn_config(listener, await activate_server_tls(settings, certlm_host))
    scheme = "https" if config.ssl_enabled else "http"
    url = f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"

    @app.before_serving
    async def announce() -> None:
        # What start-up made (modules, models, plugins) lives as long as the process. Frozen out of the collector's
        # sight, a full collection walks only what requests made since: unfrozen, it held the event loop for 100 ms
        # and more during large listings (bench/bench_loop_stall.py).
        gc.collect()
        gc.freeze()
        gc.set_threshold(*COLLECTOR_THRESHOLDS)
        log.info("Running on %s (data in %s; Ctrl-C stops it)", url, settings.data_dir)
        if after_start is not None:
            app.add_background_task(after_start, url)

    drain = Drain(app)
    app.before_request(drain.note_handler)
    stop = asyncio.Event()

    received: list[str] = []

    def on_signal(name: str) -> None:
        if stop.is_set():
            log.warning("%s again: no longer waiting for the operations in flight", name)
            drain.abandon()
        else:
            received.append(name)
            stop.set()

    # A stop with nothing in flight is said in the log file only: the console (the demo's summary) stays as it was.
    quiet: dict[str, Any] = {}

    async def drained() -> None:
        await stop.wait()
        scans = certlm_host.schedulers.scanning()
        if drain.in_flight == 0 and not scans:
            quiet.update(FILE_ONLY)
            drain.draining = True
            log.info("%s: stopping, nothing in flight", received[0], extra=quiet)
            return
        log.info(
            "%s: draining: %d request(s) and %d scheduler scan(s) in flight get up to %gs to finish; new requests "
            "are answered 503 and the schedulers start no device more",
            received[0], drain.in_flight, len(scans), settings.shutdown_grace_s,
        )  # fmt: skip
        requests_done, scans_done = await asyncio.gather(
            drain.drain(settings.shutdown_grace_s), certlm_host.schedulers.drain(settings.shutdown_grace_s)
        )
        if not scans_done:
            log.warning("not drained: the renewals or reads still running are cancelled (their leases are released)")
        if requests_done and scans_done:
            log.info("drained: every operation in flight finished")
        elif not requests_done:
            log.warning(
                "not drained: %d request(s) still in flight are cancelled (their device leases are released)",
                drain.in_flight,
            )
            await drain.cancel_in_flight(SHUTDOWN_CANCEL_AFTER_S)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)
    await hypercorn_serve(CloseAfterUnreadBody(drain), config, shutdown_trigger=drained)
    log.info("stopped: storage closed", extra=quiet)
