"""Running the app under hypercorn, over HTTPS when a TLS server certificate has been installed."""

from __future__ import annotations

import asyncio
import logging
import signal

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

from certlm.app import create_app
from certlm.config import Settings

log = logging.getLogger(__name__)


def hypercorn_config(settings: Settings, host: str, port: int) -> Config:
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.errorlog = "-"
    return config


async def serve(settings: Settings, host: str, port: int) -> None:
    app = create_app(settings)
    config = hypercorn_config(settings, host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    scheme = "https" if config.ssl_enabled else "http"
    print(f"certlm listening on {scheme}://{host}:{port} (data in {settings.data_dir})", flush=True)
    await hypercorn_serve(app, config, shutdown_trigger=stop.wait)
