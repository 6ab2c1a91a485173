"""certlm: certificate lifecycle management for OPC UA devices.

Vendors write plugins against the names re-exported here: ``from certlm import hookimpl, DeviceDriver, PkiBackend``.
The contracts are ``certlm.contracts.hookspecs`` (the hooks), ``certlm.contracts.drivers`` (a device driver) and
``certlm.contracts.pki_backends``
(a PKI backend).
"""

__version__ = "0.1.0"  # first: the modules imported below read it

from certlm.contracts.drivers import (
    CertificateReading,
    DeviceDescription,
    DeviceDriver,
    DeviceIdentity,
    DeviceIdentityChanged,
    DeviceReading,
    DeviceTarget,
    FirmwareInfo,
    PkiMaterial,
    PushFailed,
    PushOutcome,
    PushRequest,
    StepLog,
    StepNote,
    StepOutcome,
    SupportedDevice,
    TrustList,
)
from certlm.contracts.hookspecs import hookimpl
from certlm.contracts.pki_backends import (
    CLIENT_PROFILE,
    SERVER_PROFILE,
    CertificateProfile,
    CertlmKeyRequired,
    Enrollment,
    EnrollmentRequest,
    KeyedEnrollment,
    PkiBackend,
    ServerValidation,
)
from certlm.contracts.registry import DeviceDriverRegistry, HostServices, PkiBackendRegistry
from certlm.foundation.certs import api_timestamp, serial_hex
from certlm.inventory.identity import identity_repinned

__all__ = [
    "CLIENT_PROFILE",
    "SERVER_PROFILE",
    "CertificateProfile",
    "CertificateReading",
    "CertlmKeyRequired",
    "DeviceDescription",
    "DeviceDriver",
    "DeviceDriverRegistry",
    "DeviceIdentity",
    "DeviceIdentityChanged",
    "DeviceReading",
    "DeviceTarget",
    "Enrollment",
    "EnrollmentRequest",
    "FirmwareInfo",
    "HostServices",
    "KeyedEnrollment",
    "PkiBackend",
    "PkiBackendRegistry",
    "PkiMaterial",
    "PushFailed",
    "PushOutcome",
    "PushRequest",
    "ServerValidation",
    "StepLog",
    "StepNote",
    "StepOutcome",
    "SupportedDevice",
    "TrustList",
    "__version__",
    "api_timestamp",
    "hookimpl",
    "identity_repinned",
    "serial_hex",
]
