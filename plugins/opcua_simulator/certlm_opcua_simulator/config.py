"""Configuration of a simulated device: identity, users, security, push behaviour and injected failures."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from asyncua import ua

USER_ROLES = ("admin", "user")
"""``admin`` may call the push certificate management methods (SecurityAdmin), ``user`` may only browse and read."""

DEFAULT_USERS: Mapping[str, tuple[str, str]] = {
    "admin": ("admin-pw", "admin"),
    "operator": ("operator-pw", "user"),
}

DEFAULT_SECURITY_POLICIES = (
    "NoSecurity",
    "Basic256Sha256_Sign",
    "Basic256Sha256_SignAndEncrypt",
    "Aes128Sha256RsaOaep_Sign",
    "Aes128Sha256RsaOaep_SignAndEncrypt",
    "Aes256Sha256RsaPss_Sign",
    "Aes256Sha256RsaPss_SignAndEncrypt",
)
"""Names of ``asyncua.ua.SecurityPolicyType``; the deprecated Basic128Rsa15_* and Basic256_* may be added."""

FAILURE_STEPS = (
    "create_signing_request",
    "update_certificate",
    "trust_list_write",
    "apply_changes",
    "get_rejected_list",
    "trust_list_read",
)


DROP_STEPS = (
    "open",
    "write",
    "close_and_update",
    "create_signing_request",
    "update_certificate",
    "apply_changes",
    "applied",
)
"""Where ``drop_at`` cuts the caller's connection: the trust list's Open for writing, Write and CloseAndUpdate, the
ServerConfiguration methods before they run, and ``applied``: right after ApplyChanges took the changes in, before
its answer leaves."""


@dataclass(frozen=True)
class DropPoint:
    """A step at which the device closes the calling client's TCP connection (a dropped session on a slow plant
    network), on the first ``count`` calls of it (None: every call). The device stays up."""

    step: str
    count: int | None = None

    @classmethod
    def parse(cls, text: str) -> DropPoint:
        """``STEP`` or ``STEP:N``, e.g. ``update_certificate:2``."""
        step, colon, count = text.partition(":")
        if step not in DROP_STEPS:
            raise ValueError(f"unknown drop step {step!r}, expected one of {', '.join(DROP_STEPS)}")
        if not colon:
            return cls(step)
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"drop count {count!r} must be a whole number of at least 1")
        return cls(step, int(count))


@dataclass(frozen=True)
class FailurePoint:
    """A push step that fails: with ``status``, or by the device going down (``drop``)."""

    step: str
    status: int = ua.StatusCodes.BadInternalError
    drop: bool = False

    @classmethod
    def parse(cls, text: str) -> FailurePoint:
        """``STEP``, ``STEP:BadSomeStatus`` or ``STEP:drop``, e.g. ``update_certificate:drop``."""
        step, _, outcome = text.partition(":")
        if step not in FAILURE_STEPS:
            raise ValueError(f"unknown failure step {step!r}, expected one of {', '.join(FAILURE_STEPS)}")
        if not outcome:
            return cls(step)
        if outcome == "drop":
            return cls(step, drop=True)
        status = getattr(ua.StatusCodes, outcome, None)
        if not isinstance(status, int) or not outcome.startswith("Bad"):
            raise ValueError(f"unknown Bad status code {outcome!r}")
        return cls(step, status)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


@dataclass(frozen=True)
class SimulatorConfig:
    """Everything a simulated device is told at start; ``run_devices`` derives one per port from it."""

    state_dir: Path
    host: str = "127.0.0.1"
    port: int = 48500
    manufacturer: str = "certlm"
    product: str = "Simulated PLC"
    firmware: str = "1.0.0"
    application_uri: str | None = None
    """Defaults to ``urn:certlm:simulator:<product-slug>:<port>``."""
    application_name: str | None = None
    """Defaults to ``<product> <port>``."""
    users: Mapping[str, tuple[str, str]] = field(default_factory=lambda: dict(DEFAULT_USERS))
    """User name -> (password, role) with role ``admin`` or ``user``."""
    admin_user_certificates: tuple[Path | bytes, ...] = ()
    """X.509 user identity tokens (PEM/DER files or DER) that log in as a security admin."""
    security_policies: tuple[str, ...] = DEFAULT_SECURITY_POLICIES
    auto_accept: bool = False
    """Factory state: accept every client certificate while the trust list is empty."""
    trusted_client_certificates: tuple[Path | bytes, ...] = ()
    """Client application certificates (PEM/DER files or DER) in the trust list of a device's first start."""
    can_create_csr: bool = True
    fixed_key: bool = False
    """The device cannot make new keys (its key lives in a secure element): CreateSigningRequest signs with the
    current key even when asked to regenerate it."""
    csr_key_bits: int = 2048
    """RSA size of the key CreateSigningRequest makes; below 2048 models an old device a PKI must refuse."""
    private_key_formats: tuple[str, ...] = ("PEM", "PFX")
    max_trust_list_size: int = 0
    """Bytes of an encoded TrustListDataType; 0 means no limit."""
    lenient: bool = False
    """False models the strictest device: the TrustList does not open while a certificate update is pending, and
    UpdateCertificate wants a CA-issued certificate's chain and the CRL of each of its CAs in the trust list the
    caller would have after ApplyChanges. True accepts the certificate and the trust list in either order."""
    trust_list_applies_at_once: bool = False
    """CloseAndUpdate applies the trust list at once and answers applyChangesRequired False, leaving no transaction."""
    certificate_applies_at_once: bool = False
    """UpdateCertificate applies the certificate at once and answers applyChangesRequired False; the endpoints
    reopen with it ``apply_delay_s`` later (or, while the caller's transaction holds a trust list, once it ends)."""
    keeps_abandoned_changes: bool = False
    """True models node-opcua 2.157: no CancelChanges (BadNotImplemented), and the changes of a session that closed
    without ApplyChanges are kept, not discarded: the next ApplyChanges, whoever calls it, takes them in, and with them
    the key of a CreateSigningRequest no certificate came for, which leaves the device presenting a certificate its
    key does not match (every secure channel fails)."""
    trust_list_readable: bool = True
    """False models a device that lets no client read its trust list, not even a security admin: Open for reading
    and OpenWithMasks answer BadUserAccessDenied, while writing it works as usual."""
    fail_at: str | None = None
    """``STEP``, ``STEP:BadSomeStatus`` or ``STEP:drop`` with STEP one of ``FAILURE_STEPS``."""
    fail_count: int | None = None
    """How many calls of the failing step fail; None means every call."""
    fail_after: int = 0
    """How many calls of the failing step answer as usual before it fails (a device that lets its trust list be read
    once and refuses the read back after a write: ``fail_at="trust_list_read:BadUserAccessDenied", fail_after=1``)."""
    drop_at: str | None = None
    """``STEP`` or ``STEP:N`` with STEP one of ``DROP_STEPS``: close the calling client's connection (no answer) at
    that step, on its first N calls (every call without N). Unlike ``fail_at``'s ``drop`` the device stays up, and
    what the session had pending is discarded as when any session closes."""
    down_s: float | None = None
    """After a ``drop``, listen again after this many seconds; None means stay down until stopped."""
    apply_delay_s: float = 0.5
    """Time between answering ApplyChanges (or an UpdateCertificate applied at once) and dropping every channel to
    present the new certificate."""
    node_generation: int = 0
    """0: DefaultApplicationGroup's TrustList, its methods and properties have the well-known ns=0 NodeIds. N >= 1:
    they have NodeIds of the device's own namespace, other ones for each N, and a client finds them by browse path
    only (a device restarted with another N models a firmware update that moved them)."""
    operating_mode: str = "run"
    program_name: str = "Main"
    certificate_days: int = 365
    """Validity of the self-signed certificate made at a device's first start."""
    max_rejected: int = 32
    """How many rejected client certificates GetRejectedList keeps (the oldest are dropped)."""

    def __post_init__(self) -> None:
        for name, (_, role) in self.users.items():
            if role not in USER_ROLES:
                raise ValueError(f"user {name!r}: role must be one of {', '.join(USER_ROLES)}, not {role!r}")
        for policy in self.security_policies:
            if policy not in ua.SecurityPolicyType.__members__:
                raise ValueError(f"unknown security policy {policy!r}")
        if self.operating_mode not in ("run", "stop"):
            raise ValueError("operating_mode must be 'run' or 'stop'")
        if self.fail_at is not None:
            FailurePoint.parse(self.fail_at)
        if self.drop_at is not None:
            DropPoint.parse(self.drop_at)
        if self.node_generation < 0:
            raise ValueError("node_generation must be 0 or more")
        if self.max_rejected < 1:
            raise ValueError("max_rejected must be at least 1")

    @property
    def failure(self) -> FailurePoint | None:
        return FailurePoint.parse(self.fail_at) if self.fail_at else None

    @property
    def drop(self) -> DropPoint | None:
        return DropPoint.parse(self.drop_at) if self.drop_at else None

    @property
    def product_slug(self) -> str:
        return slug(self.product)

    @property
    def effective_application_uri(self) -> str:
        return self.application_uri or f"urn:certlm:simulator:{self.product_slug}:{self.port}"

    @property
    def effective_application_name(self) -> str:
        return self.application_name or f"{self.product} {self.port}"

    @property
    def device_state_dir(self) -> Path:
        return Path(self.state_dir) / str(self.port)
