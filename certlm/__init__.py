"""certlm: certificate lifecycle management for OPC UA devices.

This package's names are the plugin API: everything a device driver, a PKI backend or a plugin's routes may use, and
nothing else (a plugin imports ``certlm`` and, in its tests, ``certlm.testing``; ``tests/test_layout.py`` holds
certlm's own plugins to that). ``PLUGIN_API_VERSION`` versions it; a plugin declares the version it needs as
``CERTLM_PLUGIN_API = "1.0"`` in the module its entry point names, and CHANGELOG.md records every change.

- The hooks (``hookimpl``): ``certlm.contracts.hookspecs``.
- The device-driver contract: ``DeviceDriver`` and what it exchanges with the host (``DeviceTarget``,
  ``PushRequest``, ``StepLog``, ``PushOutcome``, ...).
- The PKI-backend contract: ``PkiBackend``, profiles and enrollments; ``pki_client``, the plumbing of PKIs reached
  over HTTP(S).
- What the host lends: ``HostServices`` (to drivers and backends when they are made, and to the routes hook),
  ``InventoryAccess`` (to the routes hook); what a plugin lends the host: ``ClientCertificateHolder``.
- Errors that become the API's answers, certificate helpers, and the shapes and helpers of routes; the role a
  route needs (``requires_role`` with ``VIEWER``, ``OPERATOR``, ``ADMIN``).
"""

from certlm.contracts.drivers import (
    CertificateReading,
    DeviceDescription,
    DeviceDriver,
    DeviceIdentity,
    DeviceIdentityChanged,
    DeviceReading,
    DeviceTarget,
    DriverSelection,
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
    plain_status,
)
from certlm.contracts.enrollment import (
    CLIENT_PROFILE,
    SERVER_PROFILE,
    CertificateProfile,
    ChainCrls,
    Enrollment,
    EnrollmentRequest,
    KeyedEnrollment,
    ServerValidation,
)
from certlm.contracts.hookspecs import hookimpl
from certlm.contracts.pki_backends import CertlmKeyRequired, PkiBackend, SuccessorIssuer
from certlm.contracts.registry import DeviceDriverRegistry, DuplicateRegistration, PkiBackendRegistry
from certlm.contracts.services import (
    ClientCertificateHolder,
    ClientCertificateIssuer,
    DeviceTimeouts,
    HostServices,
    InstalledDrivers,
    InventoryAccess,
    PresentedClientCertificate,
)
from certlm.foundation.actors import ADMIN, OPERATOR, VIEWER
from certlm.foundation.certs import (
    api_timestamp,
    crl_signed_by,
    extension_value,
    host_general_name,
    is_self_signed,
    issued_by,
    issuer_chain,
    key_usage,
    load_certificate,
    load_certificates_pem,
    load_crl,
    serial_hex,
    sha1_fingerprint,
    spki_der,
    stored_certificate,
    stored_crl,
    to_der,
    to_pem,
    with_host_names,
)
from certlm.foundation.config import Settings
from certlm.foundation.errors import (
    APIError,
    CsrRejected,
    DeviceFailure,
    Forbidden,
    NotFound,
    UnsupportedOperation,
    UpstreamUnavailable,
)
from certlm.foundation.hostspec import HostSpec, address_url
from certlm.foundation.responses import DownloadQuery, StrictBody
from certlm.foundation.secretbox import SecretBox
from certlm.foundation.version import PLUGIN_API_VERSION, __version__
from certlm.http.auth import requires_role
from certlm.http.openapi import answers, downloads
from certlm.inventory.entries import MAX_SECRET_CHARS, InventoryEntryOut, ListingPage, checked_server
from certlm.inventory.identity import identity_repinned
from certlm.lifecycle.operations import last_recorded
from certlm.pki import client as pki_client
from certlm.pki.root_key_update import (
    RootKeyUpdateRefused,
    describe_certificate,
    new_issuing_ca,
    verify_root_key_update,
)
from certlm.storage import MAX_ID
from certlm.storage.migrations import PluginMigration, SchemaEditor
from certlm.storage.models import DeviceCredential, InventoryEntry, PkiEntry
from certlm.storage.reads import forget_read, read_once
from certlm.storage.sql import rows_of
from certlm.system.settings import MAX_RENEWAL_DAYS

__all__ = [
    "ADMIN",
    "CLIENT_PROFILE",
    "MAX_ID",
    "MAX_RENEWAL_DAYS",
    "MAX_SECRET_CHARS",
    "OPERATOR",
    "PLUGIN_API_VERSION",
    "SERVER_PROFILE",
    "VIEWER",
    "APIError",
    "CertificateProfile",
    "CertificateReading",
    "CertlmKeyRequired",
    "ChainCrls",
    "ClientCertificateHolder",
    "ClientCertificateIssuer",
    "CsrRejected",
    "DeviceCredential",
    "DeviceDescription",
    "DeviceDriver",
    "DeviceDriverRegistry",
    "DeviceFailure",
    "DeviceIdentity",
    "DeviceIdentityChanged",
    "DeviceReading",
    "DeviceTarget",
    "DeviceTimeouts",
    "DownloadQuery",
    "DriverSelection",
    "DuplicateRegistration",
    "Enrollment",
    "EnrollmentRequest",
    "FirmwareInfo",
    "Forbidden",
    "HostServices",
    "HostSpec",
    "InstalledDrivers",
    "InventoryAccess",
    "InventoryEntry",
    "InventoryEntryOut",
    "KeyedEnrollment",
    "ListingPage",
    "NotFound",
    "PkiBackend",
    "PkiBackendRegistry",
    "PkiEntry",
    "PkiMaterial",
    "PluginMigration",
    "PresentedClientCertificate",
    "PushFailed",
    "PushOutcome",
    "PushRequest",
    "RootKeyUpdateRefused",
    "SchemaEditor",
    "SecretBox",
    "ServerValidation",
    "Settings",
    "StepLog",
    "StepNote",
    "StepOutcome",
    "StrictBody",
    "SuccessorIssuer",
    "SupportedDevice",
    "TrustList",
    "UnsupportedOperation",
    "UpstreamUnavailable",
    "__version__",
    "address_url",
    "answers",
    "api_timestamp",
    "checked_server",
    "crl_signed_by",
    "describe_certificate",
    "downloads",
    "extension_value",
    "forget_read",
    "hookimpl",
    "host_general_name",
    "identity_repinned",
    "is_self_signed",
    "issued_by",
    "issuer_chain",
    "key_usage",
    "last_recorded",
    "load_certificate",
    "load_certificates_pem",
    "load_crl",
    "new_issuing_ca",
    "pki_client",
    "plain_status",
    "read_once",
    "requires_role",
    "rows_of",
    "serial_hex",
    "sha1_fingerprint",
    "spki_der",
    "stored_certificate",
    "stored_crl",
    "to_der",
    "to_pem",
    "verify_root_key_update",
    "with_host_names",
]
