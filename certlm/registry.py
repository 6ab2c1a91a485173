"""What plugins register and the host looks up by name: device drivers by service id, PKI backends by type.

The base classes here are the contracts a vendor implements. Every device or PKI operation the host performs
goes through one of these registries; the host itself never branches on a protocol or PKI type.
"""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from certlm.errors import APIError, UnsupportedOperation

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.types import (
        CertificateIssuerPrivateKeyTypes,
        PrivateKeyTypes,
    )

    from certlm.config import Settings
    from certlm.secretbox import SecretBox
    from certlm.storage.models import PkiEntry


class DuplicateRegistration(RuntimeError):
    """Two installed plugins claim the same service id or PKI type."""


@dataclass(frozen=True)
class SupportedDevice:
    """A device and firmware combination a driver declares it supports. Data, never code."""

    vendor: str
    device_name: str
    firmware_versions: tuple[str, ...] = ("*",)

    def matches(self, identity: DeviceIdentity) -> bool:
        return (
            self.vendor.casefold() == identity.manufacturer.casefold()
            and self.device_name.casefold() == identity.product.casefold()
            and any(fnmatch.fnmatchcase(identity.firmware, pattern) for pattern in self.firmware_versions)
        )


@dataclass(frozen=True)
class DeviceIdentity:
    """What a device says about itself (OPC UA BuildInfo or its SSH/REST equivalent)."""

    manufacturer: str
    product: str
    firmware: str


@dataclass(frozen=True)
class HostServices:
    """What the host lends to drivers and backends: settings and the at-rest encryption of secrets."""

    settings: Settings
    secrets: SecretBox


@dataclass
class DeviceTarget:
    """Everything a driver needs to reach one inventory entry, secrets decrypted for this call only."""

    entry_id: int | None
    server: str
    port: int
    url: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    pkcs12: bytes | None = field(default=None, repr=False)
    pkcs12_password: str | None = field(default=None, repr=False)
    security_policy: int | None = None
    security_mode: int | None = None


@dataclass(frozen=True)
class FirmwareInfo:
    firmware_version: str
    device_name: str


@dataclass(frozen=True)
class DeviceDescription:
    """What a driver learns when it first meets a device: who it is and what its management interface can do.

    ``capabilities`` is driver-defined data stored with the entry (for OPC UA push: SupportedPrivateKeyFormats,
    MaxTrustListSize, certificate groups and types).
    """

    identity: DeviceIdentity
    capabilities: dict[str, Any] = field(default_factory=dict)
    certificate: x509.Certificate | None = None
    """The certificate the device presented while it was described; the host pins it on first contact."""


@dataclass(frozen=True)
class CertificateReading:
    """The application certificate a device presents, and the security the connection negotiated (bitmasks of
    ``GET /gds/systeminfo``: policy 0 and mode 0 mean none)."""

    certificate: x509.Certificate
    security_policy: int
    security_mode: int


@dataclass
class TrustList:
    """A device trust list: four lists of DER blobs (certificates or CRLs)."""

    trusted_certificates: list[bytes] = field(default_factory=list)
    trusted_crls: list[bytes] = field(default_factory=list)
    issuer_certificates: list[bytes] = field(default_factory=list)
    issuer_crls: list[bytes] = field(default_factory=list)

    # The spec's ``trustlist`` bitmask: which of the four lists a read or delete covers.
    MASK_BITS: ClassVar[dict[str, int]] = {
        "trusted_certificates": 1,
        "trusted_crls": 2,
        "issuer_certificates": 4,
        "issuer_crls": 8,
    }
    ALL: ClassVar[int] = 15


@dataclass(frozen=True)
class PkiMaterial:
    """What the host hands a driver for one enrollment: the way to get a CSR signed and what the device must
    trust afterwards. ``enroll(csr, private_key)`` takes the CSR's key when certlm made it, else None.
    ``ca_certificates`` may be empty when the PKI hands its chain out only with an enrollment (CMP
    ``caPubs``/``extraCerts``): the device then trusts the returned ``Enrollment.chain``. ``enroll`` raises
    ``certlm.errors.CsrRejected`` when the PKI refuses the request; a driver
    lets that propagate (as the ``__cause__`` of its ``PushFailed``) so the host can answer 422."""

    enroll: Callable[[x509.CertificateSigningRequest, CertificateIssuerPrivateKeyTypes | None], Awaitable[Enrollment]]
    ca_certificates: tuple[x509.Certificate, ...]
    crls: tuple[x509.CertificateRevocationList, ...]
    # For a device that cannot make keys: the PKI makes the key pair (``PkiBackend.enroll_server_key``).
    # None when the backend does not offer it; raises ``UnsupportedOperation`` when its server does not.
    enroll_server_key: Callable[[x509.CertificateSigningRequest], Awaitable[KeyedEnrollment]] | None = None
    # The CRL of every CA above an issued certificate, for devices that check revocation along the whole chain:
    # ``crls`` plus what the distribution points of the chain's certificates deliver, and one line per CA whose CRL
    # could not be had. None when nothing beyond ``crls`` can be found.
    chain_crls: Callable[[Enrollment], Awaitable[ChainCrls]] | None = None


@dataclass(frozen=True)
class ChainCrls:
    """The CRLs of an enrollment's chain, issuing CA first, and why any CA's CRL is missing."""

    crls: tuple[x509.CertificateRevocationList, ...]
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class PushRequest:
    """One enrollment as the REST call or the scheduler asked for it.

    ``pinned_certificate`` is the device certificate certlm trusts for the entry (DER) and ``trusted_cas`` the
    PKI's CA chain: a driver sends nothing (not even the user's credentials) to a device that presents neither the
    pinned certificate nor one issued by those CAs. ``trust_on_first_use`` lifts that check for an operator's first
    contact or re-onboarding: the driver accepts what the device presents and reports it as
    ``PushOutcome.presented_certificate`` (or ``PushFailed.presented_certificate``) for the host to pin. Automated
    operations never set it. ``onboarding`` also makes the device trust certlm's CA, not only its certificate."""

    subject: str | None = None
    add_issuer: bool = False
    add_client_certificate: bool = False
    onboarding: bool = False
    pinned_certificate: bytes | None = field(default=None, repr=False)
    trusted_cas: tuple[x509.Certificate, ...] = ()
    trust_on_first_use: bool = False


@dataclass
class StepOutcome:
    """One step of a push: ``status`` is the protocol's status name on failure (e.g. ``BadUserAccessDenied``)."""

    step: str
    ok: bool
    seconds: float
    status: str = ""
    message: str = ""
    warning: bool = False
    """A step that went through but found something the operator should know (``ok`` stays True)."""


@dataclass
class PushOutcome:
    """What a completed push left on the device, as verified after the device applied it; ``presented_certificate``
    is what the device presented when the push connected, before it changed."""

    certificate: x509.Certificate
    chain: tuple[x509.Certificate, ...]
    trust_list: TrustList
    security_policy: int
    security_mode: int
    steps: list[StepOutcome]
    description: DeviceDescription | None = None
    presented_certificate: x509.Certificate | None = None


class PushFailed(Exception):
    """A push that stopped at ``steps[-1]``. ``changed_device`` is False when it failed before the device was
    told to apply anything, so the device still runs on what it had. ``presented_certificate`` is what the device
    presented, when the push got that far. Raise it ``from`` the original error."""

    def __init__(
        self,
        message: str,
        steps: list[StepOutcome],
        *,
        changed_device: bool = False,
        presented_certificate: x509.Certificate | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.steps = steps
        self.changed_device = changed_device
        self.presented_certificate = presented_certificate


class DeviceDriver:
    """Base class of a device management driver. Subclass it, set the class attributes, override the
    operations the device supports; an operation left alone answers 501 naming the service.

    All operations are coroutines taking a ``DeviceTarget`` and must finish within the connection and
    operation time-outs in ``HostServices.settings``.
    """

    service: ClassVar[str]
    protocol: ClassVar[str]
    supported_devices: ClassVar[tuple[SupportedDevice, ...]] = ()
    generic: ClassVar[bool] = False

    def __init__(self, services: HostServices) -> None:
        self.services = services

    @classmethod
    def supports(cls, identity: DeviceIdentity) -> bool:
        return any(device.matches(identity) for device in cls.supported_devices)

    def _unsupported(self, operation: str) -> UnsupportedOperation:
        return UnsupportedOperation(f"service {self.service} does not support {operation}")

    async def read_firmware(self, target: DeviceTarget) -> FirmwareInfo:
        """Firmware version and device name, read live from the device."""
        raise self._unsupported("reading the firmware version")

    async def read_status(self, target: DeviceTarget) -> str:
        """The device's server state (and operating state where known), read live."""
        raise self._unsupported("reading the device status")

    async def read_plc_info(self, target: DeviceTarget) -> dict[str, Any]:
        """Driver-specific PLC metadata, read live."""
        raise self._unsupported("reading PLC information")

    async def describe(self, target: DeviceTarget) -> DeviceDescription:
        """Identity and management capabilities, read live; the host picks the entry's driver from them
        (``DeviceDriverRegistry.select_service``) when a device is registered."""
        raise self._unsupported("identifying the device")

    async def read_certificate(self, target: DeviceTarget, *, secure_session: bool) -> CertificateReading:
        """The application certificate the device presents. Without ``secure_session`` it may be read from
        the device's endpoint description; with it, from a signed and encrypted session."""
        raise self._unsupported("reading the device certificate")

    async def read_trust_list(self, target: DeviceTarget, mask: int) -> TrustList:
        """The device's trust list, the parts selected by ``mask`` (``TrustList.MASK_BITS``); others empty."""
        raise self._unsupported("reading the trust list")

    async def push(self, target: DeviceTarget, request: PushRequest, pki: PkiMaterial) -> PushOutcome:
        """Enroll a new application certificate in one session: CSR from the device (or a key made here when
        the device cannot), signed through ``pki.enroll``, installed with its chain, trust list written, the
        change applied and verified by reconnecting. Raise ``PushFailed`` with the steps done so far; a
        failure before the device applied anything must leave the device unchanged."""
        raise self._unsupported("certificate push")


@dataclass(frozen=True)
class CertificateProfile:
    """Which kind of certificate an enrollment asks for. ``hosts`` are the names or addresses the device is reached
    at: a server certificate should name them in its subject alternative names even when the device's CSR does not
    (many devices put only their applicationUri there), so a PKI that completes the SAN adds them."""

    name: str  # "client" or "server"
    hosts: tuple[str, ...] = ()


CLIENT_PROFILE = CertificateProfile("client")
SERVER_PROFILE = CertificateProfile("server")


@dataclass(frozen=True)
class ServerValidation:
    """What validating a PKI server found: where it was reached and the CA certificates it delivered."""

    host: str
    port: int
    ca_certificates: tuple[x509.Certificate, ...]


@dataclass(frozen=True)
class Enrollment:
    """An issued certificate and the chain from its issuer up to the root. ``warnings`` is what the host noticed
    about the certificate that does not stop its installation (a requested host name the PKI left out); a
    driver reports each as a warning step."""

    certificate: x509.Certificate
    chain: tuple[x509.Certificate, ...]
    warnings: tuple[str, ...] = field(default=(), kw_only=True)


@dataclass(frozen=True)
class KeyedEnrollment(Enrollment):
    """An enrollment whose key pair the PKI made: ``private_key`` goes to the device and nowhere else."""

    private_key: PrivateKeyTypes = field(repr=False, kw_only=True)


class PkiBackend:
    """Base class of a PKI backend. Subclass it, set ``pki_type`` and ``name``, override what the PKI
    offers; an operation left alone answers 501. Methods raise ``certlm.errors.APIError`` subclasses
    (``CsrRejected`` 400, ``NotFound`` 404, ``UpstreamUnavailable`` 502) with a message for the client.
    """

    pki_type: ClassVar[int]
    name: ClassVar[str]
    asks_for_profile_hosts: ClassVar[bool] = False
    """Whether every ``enroll`` asks the PKI to name ``CertificateProfile.hosts`` in the certificate beyond the CSR's
    own names (the internal CA adds them; EST, and CMP's ``p10cr``, can send only the CSR). The host warns when an
    issued certificate lacks a name that was asked for, so a backend that asks only sometimes leaves this False."""

    def __init__(self, services: HostServices) -> None:
        self.services = services

    def _unsupported(self, operation: str) -> UnsupportedOperation:
        return UnsupportedOperation(f"PKI type {self.name} does not support {operation}")

    def configuration_problems(self, entry: PkiEntry) -> list[str]:
        """Problems with a PKI entry's stored configuration, checked on create and update. No I/O."""
        return []

    async def validate(self, entry: PkiEntry, *, strict: bool) -> ServerValidation:
        """Connect to the PKI server, fetch its CA certificates and store them in ``entry.ca_certificates``;
        ``strict`` also verifies the server's TLS chain against ``entry.tls_ca``. Only PKIs reached over the
        network offer this; the default answers 400 as the spec requires for every other type."""
        raise APIError(
            f"validate requires a type 2 (EST) entry with a connection; PKI entry {entry.id} is of type "
            f"{entry.pki_type} ({self.name})"
        )

    async def ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        """The CA chain, issuing CA first. Raise ``NotFound`` when none is available yet."""
        raise self._unsupported("CA certificates")

    @classmethod
    def offers(cls, operation: str) -> bool:
        """Whether this backend implements ``operation`` (a method name such as ``"enroll_server_key"``
        or ``"revoke"``) rather than inheriting the 501 default. The host asks before optional work."""
        return getattr(cls, operation) is not getattr(PkiBackend, operation)

    async def enroll(
        self,
        entry: PkiEntry,
        csr: x509.CertificateSigningRequest,
        profile: CertificateProfile,
        *,
        renewing: x509.Certificate | None = None,
        private_key: CertificateIssuerPrivateKeyTypes | None = None,
    ) -> Enrollment:
        """Have ``csr`` signed under ``profile`` and return the certificate with its chain.

        ``renewing`` is the certificate this one replaces, when the device's current certificate was issued by
        this PKI: a PKI with a renewal transaction uses it (EST ``simplereenroll``, CMP ``kur`` with its
        ``oldCertId``); the CSR then keeps the old subject. ``private_key`` is the key of ``csr`` when certlm
        made it (the device cannot make keys): a PKI that wants proof of possession beyond the CSR's own
        signature (CMP ``ir``/``cr`` with a signature POPO) uses it. It is never stored or sent anywhere.

        The issued certificate must carry the public key of ``csr``; a backend checks that and rejects (and
        where the protocol has it, refuses to confirm) anything else. Raise ``CsrRejected`` (400) for a
        request the PKI refuses, ``UpstreamUnavailable`` (502) when it cannot be reached, does not accept
        the configured credentials or answers something that is not a valid response.
        """
        raise self._unsupported("enrollment")

    async def enroll_server_key(
        self,
        entry: PkiEntry,
        csr: x509.CertificateSigningRequest,
        profile: CertificateProfile,
        *,
        renewing: x509.Certificate | None = None,
    ) -> KeyedEnrollment:
        """Have the PKI make the key pair as well (EST ``serverkeygen``, RFC 7030 §4.4), for devices that
        cannot make keys. ``csr`` carries the subject and extensions wanted; its public key is a placeholder
        the PKI replaces. Returns the certificate, its chain and the private key, which the caller hands to
        the device and then forgets. Raise ``UnsupportedOperation`` when the server turns the request down
        as not offered (the host then makes the key itself); otherwise as ``enroll``."""
        raise self._unsupported("server-side key generation")

    async def crl(self, entry: PkiEntry) -> x509.CertificateRevocationList:
        """The current CRL of the CA. Raise ``NotFound`` without one, ``UpstreamUnavailable`` if unreachable."""
        raise self._unsupported("CRLs")

    async def revoke(self, entry: PkiEntry, certificate: x509.Certificate, reason: x509.ReasonFlags) -> None:
        """Revoke ``certificate``, issued by this PKI (CMP ``rr``, the internal CA's own CRL). The host calls it
        when a device whose certificate came from this PKI is decommissioned. Raise ``APIError`` (400) for a
        certificate this PKI did not issue, ``UpstreamUnavailable`` when the PKI cannot be reached."""
        raise self._unsupported("revocation")


def stable_device_id(service: str, device: SupportedDevice, firmware: str) -> int:
    """A positive id that stays the same across restarts and plugin install order."""
    digest = hashlib.sha256(f"{service}\0{device.vendor}\0{device.device_name}\0{firmware}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


class DeviceDriverRegistry:
    """Device driver classes by service id; what plugins fill through ``certlm_register_device_drivers``."""

    def __init__(self) -> None:
        self._classes: dict[str, type[DeviceDriver]] = {}
        self._instances: dict[str, DeviceDriver] = {}

    def add(self, driver_class: type[DeviceDriver]) -> None:
        service = driver_class.service
        if service in self._classes:
            raise DuplicateRegistration(
                f"service {service!r} registered by both {self._classes[service].__module__} "
                f"and {driver_class.__module__}"
            )
        self._classes[service] = driver_class

    def instantiate(self, services: HostServices) -> None:
        self._instances = {service: cls(services) for service, cls in self._classes.items()}

    def services(self) -> list[str]:
        return sorted(self._classes)

    def get(self, service: str) -> DeviceDriver:
        try:
            return self._instances[service]
        except KeyError:
            raise UnsupportedOperation(f"no installed plugin provides service {service!r}") from None

    def supported_devices(self) -> list[dict[str, Any]]:
        rows = []
        for service, cls in sorted(self._classes.items()):
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

    def select_service(self, protocol: str, identity: DeviceIdentity | None) -> str | None:
        """The service id of the most specific installed driver for a device, else the protocol's generic."""
        candidates = [cls for cls in self._classes.values() if cls.protocol == protocol]
        if identity is not None:
            specific = sorted(cls.service for cls in candidates if not cls.generic and cls.supports(identity))
            if specific:
                return specific[0]
        generic = sorted(cls.service for cls in candidates if cls.generic)
        return generic[0] if generic else None


class PkiBackendRegistry:
    """PKI backend classes by pki type; what plugins fill through ``certlm_register_pki_backends``."""

    def __init__(self) -> None:
        self._classes: dict[int, type[PkiBackend]] = {}
        self._instances: dict[int, PkiBackend] = {}

    def add(self, backend_class: type[PkiBackend]) -> None:
        pki_type = backend_class.pki_type
        if pki_type in self._classes:
            raise DuplicateRegistration(
                f"pki type {pki_type} registered by both {self._classes[pki_type].__module__} "
                f"and {backend_class.__module__}"
            )
        self._classes[pki_type] = backend_class

    def instantiate(self, services: HostServices) -> None:
        self._instances = {pki_type: cls(services) for pki_type, cls in self._classes.items()}

    def types(self) -> list[dict[str, Any]]:
        return [{"pki_type_id": t, "pki_type": cls.name} for t, cls in sorted(self._classes.items())]

    def known(self, pki_type: int) -> bool:
        return pki_type in self._classes

    def get(self, pki_type: int) -> PkiBackend:
        try:
            return self._instances[pki_type]
        except KeyError:
            raise UnsupportedOperation(f"no installed plugin provides pki type {pki_type}") from None
