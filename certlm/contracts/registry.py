"""What plugins register and the host looks up by name: device drivers by service id, PKI backends by type.

The contracts a vendor implements are ``certlm.contracts.drivers`` and ``certlm.contracts.pki_backends``. Every
device or PKI operation the host performs goes through one of these registries; the host itself never branches on a
protocol or PKI type.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from certlm.contracts.drivers import DeviceDriver
from certlm.contracts.pki_backends import PkiBackend
from certlm.foundation.errors import UnsupportedOperation
from certlm.foundation.hostspec import HostSpec, parse_host_or_url

if TYPE_CHECKING:
    from certlm.contracts.drivers import DeviceIdentity, SupportedDevice
    from certlm.contracts.services import HostServices
    from certlm.storage.models import PkiEntry

Key = TypeVar("Key", str, int)
Plugin = TypeVar("Plugin")


class DuplicateRegistration(RuntimeError):
    """Two installed plugins claim the same service id or PKI type."""


class Registry(Generic[Key, Plugin]):
    """Plugin classes by the key the host looks them up by, and one instance of each once the host's services exist
    (``instantiate``). ``describe`` names a key in messages (``service 'gds-push-generic'``, ``pki type 2``)."""

    def __init__(self, key_of: Callable[[type[Plugin]], Key], describe: Callable[[Key], str]) -> None:
        self._key_of = key_of
        self._describe = describe
        self._classes: dict[Key, type[Plugin]] = {}
        self._instances: dict[Key, Plugin] = {}

    def add(self, plugin_class: type[Plugin]) -> None:
        key = self._key_of(plugin_class)
        if key in self._classes:
            raise DuplicateRegistration(
                f"{self._describe(key)} registered by both {self._classes[key].__module__} "
                f"and {plugin_class.__module__}"
            )
        self._classes[key] = plugin_class

    def instantiate(self, services: HostServices) -> None:
        self._instances = {key: cls(services) for key, cls in self._classes.items()}  # type: ignore[call-arg]

    def known(self, key: Key) -> bool:
        return key in self._classes

    def get(self, key: Key) -> Plugin:
        try:
            return self._instances[key]
        except KeyError:
            raise UnsupportedOperation(f"no installed plugin provides {self._describe(key)}") from None

    def classes(self) -> list[tuple[Key, type[Plugin]]]:
        """The registered classes by key, in key order."""
        return sorted(self._classes.items())


def stable_device_id(service: str, device: SupportedDevice, firmware: str) -> int:
    """A positive id that stays the same across restarts and plugin install order."""
    digest = hashlib.sha256(f"{service}\0{device.vendor}\0{device.device_name}\0{firmware}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def _manages(driver: type[DeviceDriver], table: str) -> bool:
    return table == driver.protocol or table in driver.extra_tables


class DeviceDriverRegistry(Registry[str, DeviceDriver]):
    """Device driver classes by service id; what plugins fill through ``certlm_register_device_drivers``."""

    def __init__(self) -> None:
        super().__init__(lambda driver: driver.service, lambda service: f"service {service!r}")
        # The plugin API each driver's plugin declared (``CERTLM_PLUGIN_API``), by service; what the host asks before
        # it relies on something a later minor version added (a campaign needs 1.1's trust-list writes).
        self._plugin_api: dict[str, str] = {}
        self._registering_plugin_api: str | None = None

    def add(self, plugin_class: type[DeviceDriver]) -> None:
        super().add(plugin_class)
        if self._registering_plugin_api is not None:
            self._plugin_api[plugin_class.service] = self._registering_plugin_api

    @contextlib.contextmanager
    def registering_for(self, plugin_api: str | None) -> Iterator[None]:
        """For the host: the drivers ``add``-ed meanwhile come from a plugin that declared ``plugin_api``."""
        self._registering_plugin_api = plugin_api
        try:
            yield
        finally:
            self._registering_plugin_api = None

    def plugin_api(self, service: str) -> str | None:
        """The plugin API the driver's plugin declared; None when it declared none (taken as this certlm's)."""
        return self._plugin_api.get(service)

    def offers_plugin_api(self, service: str, needed: tuple[int, int]) -> bool:
        """Whether the driver of ``service`` was written for plugin API ``needed`` or a later minor version of it (a
        plugin that declared none is taken as written for this certlm's)."""
        declared = self._plugin_api.get(service)
        if declared is None:
            return True
        major, _, minor = declared.partition(".")
        return (int(major), int(minor or 0)) >= needed

    def services(self) -> list[str]:
        return [service for service, _ in self.classes()]

    def supported_devices(self) -> list[dict[str, Any]]:
        rows = []
        for service, cls in self.classes():
            for device in cls.supported_devices:
                for firmware in device.firmware_versions:
                    rows.append(
                        {
                            "id": stable_device_id(service, device, firmware),
                            "device_name": device.device_name,
                            "firmware_version": firmware,
                            "vendor": device.vendor,
                            "service": service,
                        }
                    )
        return rows

    def services_of(self, table: str) -> list[str]:
        """The service ids of the installed drivers that manage entries of inventory table ``table``."""
        return [service for service, cls in self.classes() if _manages(cls, table)]

    def url_schemes(self) -> list[str]:
        """The URL schemes of the installed drivers, each once."""
        return sorted({cls.url_scheme for _, cls in self.classes()})

    def parse_address(self, host_or_url: str) -> HostSpec:
        """The ``{host_or_url}`` of a route (``host``, ``host:port`` or a URL in an installed driver's scheme); 400
        naming the accepted spellings otherwise."""
        return parse_host_or_url(host_or_url, self.url_schemes())

    def driver_of(self, table: str, service: str | None) -> type[DeviceDriver] | None:
        """The driver class that says how an entry of ``table`` is reached (its URL scheme, its default port): the
        one of ``service`` when installed, else the table's generic driver; None when no installed plugin manages
        the table."""
        if service is not None and self.known(service):
            return self._classes[service]
        generic = self.select_service(table, None)
        return self._classes[generic] if generic is not None else None

    def select_service(self, protocol: str, identity: DeviceIdentity | None) -> str | None:
        """The service id of the most specific installed driver for a device of inventory table ``protocol``, else
        the table's generic driver; None when no installed plugin manages the table."""
        candidates = [cls for _, cls in self.classes() if _manages(cls, protocol)]
        if identity is not None:
            specific = sorted(cls.service for cls in candidates if not cls.generic and cls.supports(identity))
            if specific:
                return specific[0]
        generic = sorted(cls.service for cls in candidates if cls.generic)
        return generic[0] if generic else None


class PkiBackendRegistry(Registry[int, PkiBackend]):
    """PKI backend classes by pki type; what plugins fill through ``certlm_register_pki_backends``."""

    def __init__(self) -> None:
        super().__init__(lambda backend: backend.pki_type, lambda pki_type: f"pki type {pki_type}")

    def types(self) -> list[dict[str, Any]]:
        return [{"pki_type_id": pki_type, "pki_type": cls.name} for pki_type, cls in self.classes()]

    def validation_refused(self, entry: PkiEntry) -> str:
        """Why ``entry`` cannot be validated, as the spec words it for a type whose plugin connects to no server: the
        installed types that can be, by their protocol's acronym (with EST installed: "requires a type 2 (EST)
        entry")."""
        validating = [
            f"type {pki_type} ({cls.name.upper()})" for pki_type, cls in self.classes() if cls.offers("validate")
        ]
        required = (
            f"a {' or '.join(validating)} entry with a connection"
            if validating
            else "a PKI type whose plugin connects to a server, and no installed plugin provides one"
        )
        name = self._classes[entry.pki_type].name if self.known(entry.pki_type) else "not installed"
        return f"validate requires {required}; PKI entry {entry.id} is of type {entry.pki_type} ({name})"
