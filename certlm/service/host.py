"""The running host put together: every part the app factory made, as request handlers reach it
(``current_host()``, the one look-up, used by the HTTP surface only). The rooms below are handed what they use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from quart import current_app

if TYPE_CHECKING:
    import pluggy

    from certlm.contracts.registry import DeviceDriverRegistry, PkiBackendRegistry
    from certlm.contracts.services import HostServices
    from certlm.foundation.config import Settings
    from certlm.foundation.secretbox import SecretBox
    from certlm.inventory.entries import Inventory
    from certlm.lifecycle.campaigns import CampaignRunner
    from certlm.lifecycle.identification import IdentificationQueue
    from certlm.lifecycle.metrics import SchedulerMetrics
    from certlm.lifecycle.runtime import Runtime
    from certlm.lifecycle.schedulers import Schedulers
    from certlm.pki.publication import PublishedCrls
    from certlm.pki.revocation import CrlCache
    from certlm.storage.migrations import PluginMigration
    from certlm.system.licensing import LicenseService


@dataclass
class Host:
    runtime: Runtime
    plugin_manager: pluggy.PluginManager
    api_key: str
    schedulers: Schedulers
    metrics: SchedulerMetrics
    identification: IdentificationQueue
    published_crls: PublishedCrls
    campaigns: CampaignRunner
    schema_version: int | None = None
    model_modules: list[str] = field(default_factory=list)
    """The plugins' model modules and migration steps, which the database is opened with."""
    plugin_migrations: list[PluginMigration] = field(default_factory=list)

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    @property
    def secrets(self) -> SecretBox:
        return self.runtime.secrets

    @property
    def services(self) -> HostServices:
        return self.runtime.services

    @property
    def drivers(self) -> DeviceDriverRegistry:
        return self.runtime.drivers

    @property
    def pki_backends(self) -> PkiBackendRegistry:
        return self.runtime.pki_backends

    @property
    def licenses(self) -> LicenseService:
        return self.runtime.licenses

    @property
    def inventory(self) -> Inventory:
        return self.runtime.inventory

    @property
    def crl_cache(self) -> CrlCache:
        return self.runtime.crl_cache


def current_host() -> Host:
    return current_app.extensions["certlm"]
