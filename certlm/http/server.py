"""Running the app under hypercorn, over HTTPS when a TLS server certificate has been installed."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import ssl
from collections.abc import Awaitable, Callable

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
from certlm.http.app import create_app
from certlm.service.host import Host
from certlm.storage import close_storage, open_storage
from certlm.storage.migrations import PluginMigrationFailed
from certlm.system.tls import ServerTls, prepare_server_tls, server_ssl_context

log = logging.getLogger(__name__)


class CertlmConfig(Config):
    """hypercorn's settings, serving TLS under certlm's policy (``certlm.system.tls``) instead of hypercorn's."""

    def create_ssl_context(self) -> ssl.SSLContext | None:
        if not self.ssl_enabled:
            return None
        return server_ssl_context(self.certfile, self.keyfile, self.keyfile_password, self.alpn_protocols)


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
    except PluginMigrationFailed as error:
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
    background task, given the service's base URL."""
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
        log.info("Running on %s (data in %s; Ctrl-C stops it)", url, settings.data_dir)
        if after_start is not None:
            app.add_background_task(after_start, url)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await hypercorn_serve(CloseAfterUnreadBody(app), config, shutdown_trigger=stop.wait)
