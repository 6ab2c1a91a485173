"""The running host's parts, as the request handlers and plugins see them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from quart import current_app

if TYPE_CHECKING:
    import pluggy

    from certlm.contracts.registry import DeviceDriverRegistry, HostServices, PkiBackendRegistry
    from certlm.foundation.config import Settings
    from certlm.foundation.secretbox import SecretBox
    from certlm.lifecycle.identification import IdentificationQueue
    from certlm.lifecycle.metrics import SchedulerMetrics
    from certlm.lifecycle.schedulers import Schedulers
    from certlm.system.licensing import LicenseService


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
