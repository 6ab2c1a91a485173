"""The device-driver contract: what a plugin implements to manage one kind of device, and the data it exchanges with
the host. A vendor reads this module on its own: subclass ``DeviceDriver``, register it through
``certlm_register_device_drivers``; ``certlm`` re-exports what a driver needs.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from certlm.contracts.enrollment import ChainCrls, Enrollment, KeyedEnrollment
from certlm.foundation.errors import APIError, DeviceFailure, UnsupportedOperation

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric.types import CertificateIssuerPrivateKeyTypes

    from certlm.contracts.services import HostServices


class DeviceIdentityChanged(DeviceFailure):
    """The device presented another identity than the one pinned for it on its management channel: an SSH host key,
    the TLS certificate of its REST API. A driver raises it instead of talking to the device (it sent nothing, its
    credentials least of all). ``what`` names the identity (``SSH host key``), ``pinned`` and ``presented`` describe
    each side for a person (algorithm and SHA-256 fingerprint, or subject and SHA-1), and ``remedy`` says how an
    operator re-pins once the change is explained.

    The monitor marks the entry with it (``identity_changed`` with this message) and keeps the mark, counted in
    ``/metrics`` and shown in the dashboard, until an operator re-pins (``certlm.identity_repinned``)."""

    def __init__(self, what: str, pinned: str, presented: str, remedy: str, device_status: str = "BadIdentityChanged"):
        super().__init__(
            f"the device presented another {what} than the one pinned: pinned {pinned}, presented {presented}. "
            f"certlm sent it nothing. {remedy}",
            device_status,
        )
        self.what = what
        self.pinned = pinned
        self.presented = presented


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


@dataclass
class DeviceTarget:
    """Everything a driver needs to reach one inventory entry, secrets decrypted for this call only.

    ``pinned_certificate`` (DER) is the device certificate certlm trusts for the entry: a driver sends the entry's
    credentials to no device that presents another one (a push checks ``PushRequest`` instead). None when certlm
    has not met the device yet."""

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
    pinned_certificate: bytes | None = field(default=None, repr=False)


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
    ``certlm.foundation.errors.CsrRejected`` when the PKI refuses the request; a driver
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
class PushOptions:
    """What the REST call or the scheduler asks of one enrollment: the subject (None keeps the device's), whether
    the device is to trust certlm's CA (``add_issuer``) or certlm's own certificate (``add_client_certificate``), and
    whether it is an onboarding, which makes the device trust certlm's CA, not only its certificate."""

    subject: str | None = None
    add_issuer: bool = False
    add_client_certificate: bool = False
    onboarding: bool = False


DriverSelection = Callable[[DeviceDescription], Awaitable["DeviceDriver"]]
"""The host's choice of driver for what a device said about itself (see ``PushRequest.identify``)."""


@dataclass(frozen=True)
class PushRequest(PushOptions):
    """One enrollment as asked for (``PushOptions``), with what the host decided about the device for this push.

    ``pinned_certificate`` is the device certificate certlm trusts for the entry (DER) and ``trusted_cas`` the
    PKI's CA chain: a driver sends nothing (not even the user's credentials) to a device that presents neither the
    pinned certificate nor one issued by those CAs. ``trust_on_first_use`` lifts that check for an operator's first
    contact or re-onboarding: the driver accepts what the device presents and reports it as
    ``PushOutcome.presented_certificate`` (or ``PushFailed.presented_certificate``) for the host to pin. Automated
    operations never set it.

    ``identify`` comes with an operator's first contact: a driver that describes the device in its push session
    calls it with that description, as the step ``identify``, before it asks the device for anything else. The host
    stores the description and answers with the driver it selects; the push goes on with that driver in the same
    session where the driver can (the generic OPC UA push driver does for its subclasses, the vendors' drivers), else
    it hands the push over to that driver's ``push`` with the device pinned. A driver that ignores it leaves the
    choice to ``PushOutcome.description``."""

    pinned_certificate: bytes | None = field(default=None, repr=False)
    trusted_cas: tuple[x509.Certificate, ...] = ()
    trust_on_first_use: bool = False
    identify: DriverSelection | None = field(default=None, repr=False, compare=False)
    # What the device must go on trusting beside what the push writes from the PKI (plugin API 1.1): a campaign that
    # moves devices to another issuer keeps the other issuer's chain and CRLs trusted until its retire phase, so that
    # no peer still presenting a certificate of that issuer is refused. A driver writes these into the lists of the
    # same names together with its own, never drops them, and reports them in ``PushOutcome.trust_list``.
    also_trusted: TrustList = field(default_factory=TrustList, repr=False)

    @classmethod
    def asked(cls, options: PushOptions, **decided: Any) -> PushRequest:
        """The request for what ``options`` asks (a ``certlm.lifecycle.push.PushOrder`` among them), with the fields the
        host ``decided``."""
        asked = {option.name: getattr(options, option.name) for option in fields(PushOptions)}
        return cls(**asked, **decided)


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


def plain_status(error: BaseException) -> str:
    """A failed step's status when the driver knows no protocol status for it: ``DeviceFailure.device_status``,
    else the error's class name."""
    return error.device_status if isinstance(error, DeviceFailure) else type(error).__name__


def plain_explanation(error: BaseException) -> str:
    """A failed step's reason: an ``APIError``'s message, else the error's text, else its class name."""
    return error.message if isinstance(error, APIError) else str(error) or type(error).__name__


@dataclass
class StepNote:
    """What a step of ``StepLog`` reports when it succeeds."""

    message: str = ""
    status: str = ""


@dataclass
class StepLog:
    """The steps of one push as a driver runs them: ``async with log.step("enroll") as note:`` times the step and
    records it (``note`` takes its message); the first step that raises becomes ``PushFailed``, raised from the
    original error, with every step so far and what the driver set in ``changed_device`` and
    ``presented_certificate``. ``status_of`` and ``explain`` name a failure in the protocol's terms (OPC UA status
    names for the GDS push driver)."""

    status_of: Callable[[BaseException], str] = plain_status
    explain: Callable[[BaseException], str] = plain_explanation
    steps: list[StepOutcome] = field(default_factory=list)
    changed_device: bool = False
    presented_certificate: x509.Certificate | None = None

    @asynccontextmanager
    async def step(self, name: str) -> AsyncIterator[StepNote]:
        note, started = StepNote(), time.monotonic()
        try:
            yield note
        except PushFailed:
            raise
        except Exception as error:
            self.fail(name, error, started)
        self.steps.append(StepOutcome(name, True, time.monotonic() - started, note.status, note.message))

    def warn(self, name: str, message: str) -> None:
        """A step that goes through with something the operator should know."""
        self.steps.append(StepOutcome(name, True, 0.0, message=message, warning=True))

    def outcome(
        self,
        enrollment: Enrollment,
        trust_list: TrustList,
        *,
        description: DeviceDescription | None = None,
        security_policy: int = 0,
        security_mode: int = 0,
    ) -> PushOutcome:
        """The ``PushOutcome`` of a push that went through: the issued certificate and chain, the trust list written,
        the steps so far and what the device presented when the push connected. ``security_policy`` and
        ``security_mode`` are the OPC UA session's (bitmasks of ``GET /gds/systeminfo``; 0 where the push used no
        OPC UA session)."""
        return PushOutcome(
            certificate=enrollment.certificate,
            chain=enrollment.chain,
            trust_list=trust_list,
            security_policy=security_policy,
            security_mode=security_mode,
            steps=list(self.steps),
            description=description,
            presented_certificate=self.presented_certificate,
        )

    def fail(self, name: str, error: Exception, started: float | None = None) -> NoReturn:
        """Record ``name`` as failed with ``error`` and raise ``PushFailed`` from it."""
        seconds = time.monotonic() - started if started is not None else 0.0
        # "<step> failed: <why>", without repeating a prefix the error's own explanation already has.
        why, prefix = self.explain(error), f"{name} failed: "
        message = why if why.startswith(prefix) else prefix + why
        self.steps.append(StepOutcome(name, False, seconds, self.status_of(error), message))
        raise PushFailed(
            message,
            list(self.steps),
            changed_device=self.changed_device,
            presented_certificate=self.presented_certificate,
        ) from error


class PushFailed(Exception):
    """A push that stopped at ``steps[-1]``. ``changed_device`` is False when it failed before the device was
    told to apply anything, so the device still runs on what it had. ``presented_certificate`` is what the device
    presented, when the push got that far. ``changes_pending`` (plugin API 1.1) is True when the device may still
    hold changes of this push that it could not discard (an OPC UA server without CancelChanges keeps a new key
    from CreateSigningRequest, a certificate from UpdateCertificate, a trust list closed without ApplyChanges, and
    takes them in at its next ApplyChanges): the host then writes no trust list to the device until a push goes
    through. Raise it ``from`` the original error."""

    def __init__(
        self,
        message: str,
        steps: list[StepOutcome],
        *,
        changed_device: bool = False,
        presented_certificate: x509.Certificate | None = None,
        changes_pending: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.steps = steps
        self.changed_device = changed_device
        self.presented_certificate = presented_certificate
        self.changes_pending = changes_pending


@dataclass(frozen=True)
class DeviceReading:
    """What the monitor scheduler reads from a device certlm is in contact with, on one visit; a part the driver does
    not offer is None."""

    trust_list: TrustList | None = None
    firmware: FirmwareInfo | None = None
    status: str | None = None
    # Plugin API 1.1: the client certificates the device refused (``DeviceDriver.read_rejected_list``); None when
    # the driver or the device does not list them.
    rejected_certificates: list[x509.Certificate] | None = None


class DeviceDriver:
    """Base class of a device management driver. Subclass it, set the class attributes, override the
    operations the device supports; an operation left alone answers 501 naming the service.

    The class attributes a driver declares, which the host reads without calling it:

    - ``service``: the id an inventory entry names its driver by, as the spec writes it (``gds-push-<identifier>``,
      ``ssh-<identifier>``, ``rest-<identifier>``).
    - ``protocol``: the inventory table whose entries it manages (``gds``, ``ssh``, ``rest``); ``extra_tables`` names
      further tables holding the same kind of device (the GDS push drivers also manage the ``opc`` table).
    - ``url_scheme`` and ``default_port``: how the entry's ``url`` is written (``opc.tcp`` and 4840 give
      ``opc.tcp://host:4840``; an SSH driver would say ``ssh`` and 22) and the port an entry gets when its request
      names none. The host accepts the schemes of the installed drivers in ``{host_or_url}``.
    - ``generic``: the driver for any device of its table. A new entry gets its table's generic driver until its
      device identifies itself; an entry of a table no installed plugin manages is stored unmanaged and its
      operations answer 501.
    - ``supported_devices``: the devices a specific driver is chosen for (``DeviceDriverRegistry.select_service``).

    All operations are coroutines taking a ``DeviceTarget`` and must finish within the connection and
    operation time-outs in ``HostServices.settings``.

    Errors, and what the host does with them:

    - A read (``read_*``, ``describe``) that fails raises ``certlm.foundation.errors.DeviceFailure`` with the message
    the client sees and ``device_status``, the protocol's status name (OPC UA ``BadTimeout``); the host answers 502
      (400 or 500 where the spec says so for that endpoint) and stores nothing.
    - ``push`` raises ``PushFailed`` with every step so far (each failed step with its status name), raised
      ``from`` the original error: ``certlm.foundation.errors.CsrRejected`` as the cause makes the host answer 422, a
      4xx ``APIError`` from the PKI that status, anything else 500. The host records the failure as the entry's last
      push, with ``device_changed``.
    - An operation the device cannot do raises ``certlm.foundation.errors.UnsupportedOperation`` (501).
    - A device whose management channel presents another identity than the pinned one (SSH host key, REST TLS
      certificate) raises ``DeviceIdentityChanged``, from any operation, and sends the device nothing; a push raises
      it as the cause of its ``PushFailed``. The monitor marks the entry until an operator re-pins.

    Two names the host relies on: a push's first device step is called ``connect``, and once it succeeded the
    device accepted the credentials, which the host then stores for later automated operations; and
    ``PushOutcome.description``, when given, makes the host select the entry's driver again from it (a firmware
    update may call for another driver).
    """

    service: ClassVar[str]
    protocol: ClassVar[str]
    extra_tables: ClassVar[tuple[str, ...]] = ()
    url_scheme: ClassVar[str]
    default_port: ClassVar[int]
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

    async def write_trust_list(self, target: DeviceTarget, trust_list: TrustList) -> TrustList | None:
        """Make ``trust_list`` (all four parts) the device's trust list and take it into use, in one session; return
        the trust list the device holds afterwards, read back from it, or None when the device does not let it be
        read (the host then reports the write as not verified rather than trust it).

        Plugin API 1.1. The host composes ``trust_list`` from what ``read_trust_list`` returned with its changes (a
        campaign adds a new issuer's chain and CRLs, or later removes the old issuer's), so it keeps what lets
        certlm in; a driver refuses (``DeviceFailure``) a list that would lock certlm out, and writes nothing then.
        This is an automated operation: it connects as ``read_*`` do, with the pinned identity (``DeviceTarget``)
        and the stored credentials, and raises ``DeviceIdentityChanged`` when the device presents another. A failure
        before the device took the new list into use leaves the old one in force."""
        raise self._unsupported("writing the trust list")

    async def read_device(self, target: DeviceTarget) -> DeviceReading:
        """The trust list (all parts), firmware, status and rejected client certificates for the monitor scheduler,
        which visits every device each scan: override it to read them in one session. The default asks
        ``read_trust_list``, ``read_firmware``, ``read_status`` and ``read_rejected_list`` in turn and leaves out what
        raises ``UnsupportedOperation``."""
        parts: dict[str, Any] = {}
        reads = {
            "trust_list": lambda: self.read_trust_list(target, TrustList.ALL),
            "firmware": lambda: self.read_firmware(target),
            "status": lambda: self.read_status(target),
            "rejected_certificates": lambda: self.read_rejected_list(target),
        }
        for part, read in reads.items():
            try:
                parts[part] = await read()
            except UnsupportedOperation:
                continue
        return DeviceReading(**parts)

    async def push(self, target: DeviceTarget, request: PushRequest, pki: PkiMaterial) -> PushOutcome:
        """Enroll a new application certificate in one session: CSR from the device (or a key made here when
        the device cannot), signed through ``pki.enroll``, installed with its chain, trust list written, the
        change applied and verified by reconnecting. Raise ``PushFailed`` with the steps done so far; a
        failure before the device applied anything must leave the device unchanged."""
        raise self._unsupported("certificate push")

    async def change_trust_list(
        self, target: DeviceTarget, compose: Callable[[TrustList], TrustList | None]
    ) -> TrustList | None:
        """Read the device's trust list (all four parts), let ``compose`` make the list to write from it, write that
        and take it into use, as ``write_trust_list`` does; the trust list the device holds afterwards, read back, or
        None when it does not let it be read back. ``compose`` answers None when the device holds what it needs
        already: nothing is written then, and the list read is the answer.

        Plugin API 1.1. A fleet campaign changes every device's trust list this way, read-modify-write under the
        device's lease. The default reads with ``read_trust_list`` and writes with ``write_trust_list``, so a driver
        that has both has this too; a driver that can do it in fewer sessions (read, write and read back in one where
        the device allows) overrides it. ``compose`` is plain code: it does not block and raises nothing."""
        current = await self.read_trust_list(target, TrustList.ALL)
        wanted = compose(current)
        if wanted is None:
            return current
        return await self.write_trust_list(target, wanted)

    async def read_rejected_list(self, target: DeviceTarget) -> list[x509.Certificate]:
        """The client certificates the device refused to talk to and still lists (OPC UA Part 12 GetRejectedList, a
        file store's ``rejected/`` folder), each once, read live. Plugin API 1.1.

        The monitor stores what it finds (``GET /gds/rejected``) and an operator may approve one: the host then adds
        that certificate, or its issuer, to the device's trust list through ``read_trust_list`` and
        ``write_trust_list``. A chain the device kept with a certificate comes as its certificates in turn (the
        issuer after what it issued), so that its CA can be approved. A device that does not list them (the method
        missing, or refused to certlm's user) raises ``UnsupportedOperation`` naming why."""
        raise self._unsupported("listing the client certificates the device rejected")
