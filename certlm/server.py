"""Running the app under hypercorn, over HTTPS when a TLS server certificate has been installed."""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
from collections.abc import Awaitable, Callable

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

from certlm.app import create_app
from certlm.config import Settings
from certlm.host import Host
from certlm.secretbox import SecretBox
from certlm.storage import close_storage, open_storage
from certlm.tls import ServerTls, prepare_server_tls, server_ssl_context

log = logging.getLogger(__name__)


class CertlmConfig(Config):
    """hypercorn's settings, serving TLS under certlm's policy (``certlm.tls``) instead of hypercorn's."""

    def create_ssl_context(self) -> ssl.SSLContext | None:
        if not self.ssl_enabled:
            return None
        return server_ssl_context(self.certfile, self.keyfile, self.keyfile_password, self.alpn_protocols)


def hypercorn_config(settings: Settings, host: str, port: int, tls: ServerTls | None = None) -> Config:
    """Listen on ``host:port``, with TLS when ``tls`` is given."""
    config = CertlmConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = "-"
    if tls is not None:
        config.certfile = str(tls.files.cert_file)
        config.keyfile = str(tls.files.key_file)
        config.keyfile_password = tls.key_password
    return config


async def activate_server_tls(settings: Settings, secret_box: SecretBox) -> ServerTls | None:
    """Settle the TLS certificate before hypercorn binds, which needs it before the app's own start-up.

    Storage is opened with the host's models only and closed again; the app opens it afresh in
    ``before_serving``, and that second start creates any plugin tables.
    """
    await open_storage(settings.database_url, [])
    try:
        return await prepare_server_tls(settings.data_dir, secret_box)
    finally:
        await close_storage()


async def serve(
    settings: Settings, host: str, port: int, after_start: Callable[[], Awaitable[None]] | None = None
) -> None:
    """Serve until SIGINT or SIGTERM; ``after_start`` runs as a background task once the app has started."""
    app = create_app(settings)
    if after_start is not None:

        @app.before_serving
        async def start_after_start() -> None:
            app.add_background_task(after_start)

    certlm_host: Host = app.extensions["certlm"]
    config = hypercorn_config(settings, host, port, await activate_server_tls(settings, certlm_host.secrets))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    scheme = "https" if config.ssl_enabled else "http"
    print(f"certlm listening on {scheme}://{host}:{port} (data in {settings.data_dir})", flush=True)
    await hypercorn_serve(app, config, shutdown_trigger=stop.wait)
