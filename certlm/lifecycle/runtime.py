"""The running host's parts that the device lifecycle works with: settings, the encryption of secrets, the registries
of drivers and PKI backends, the services lent to plugins, the license, the CRL cache and the inventory. The app
factory makes one ``Runtime`` and hands it to the lifecycle's functions and loops; nothing below the HTTP surface looks
the host up. The rooms below the lifecycle take the single parts they need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from certlm.contracts.registry import DeviceDriverRegistry, PkiBackendRegistry
    from certlm.contracts.services import ClientCertificateHolder, HostServices
    from certlm.foundation.config import Settings
    from certlm.foundation.secretbox import SecretBox
    from certlm.inventory.entries import Inventory
    from certlm.pki.revocation import CrlCache
    from certlm.system.licensing import LicenseService


@dataclass(frozen=True)
class Runtime:
    settings: Settings
    secrets: SecretBox
    services: HostServices
    drivers: DeviceDriverRegistry
    pki_backends: PkiBackendRegistry
    licenses: LicenseService
    crl_cache: CrlCache
    inventory: Inventory
    client_certificates: tuple[ClientCertificateHolder, ...] = ()
    """certlm's own client certificates the plugins present to devices (``certlm_provide_client_certificates``)."""
