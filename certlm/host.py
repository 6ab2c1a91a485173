"""The running host's parts, as the request handlers and plugins see them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from quart import current_app

if TYPE_CHECKING:
    import pluggy

    from certlm.config import Settings
    from certlm.identification import IdentificationQueue
    from certlm.licensing import LicenseService
    from certlm.metrics import SchedulerMetrics
    from certlm.registry import DeviceDriverRegistry, HostServices, PkiBackendRegistry
    from certlm.schedulers import Schedulers
    from certlm.secretbox import SecretBox


@dataclass
class Host:
    settings: Settings
    secrets: SecretBox
    services: HostServices
    plugin_manager: pluggy.PluginManager
    drivers: DeviceDriverRegistry
    pki_backends: PkiBackendRegistry
    api_key: str
    licenses: LicenseService
    schedulers: Schedulers
    metrics: SchedulerMetrics
    identification: IdentificationQueue
    schema_version: int | None = None


def current_host() -> Host:
    return current_app.extensions["certlm"]
