"""The host's tables. Secrets are stored only as SecretBox tokens, in fields whose names end in ``_enc``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tortoise import fields
from tortoise.backends.base.client import BaseDBAsyncClient
from tortoise.indexes import Index
from tortoise.models import Model as TortoiseModel
from tortoise.models import ModelMeta


class _WithoutSourceComments(ModelMeta):
    """tortoise reads each model's source file when the class is made, to find field comments written as ``#:``;
    certlm documents its fields in docstrings and has none, and the reading was a quarter of every start-up (the
    service's and each CLI command's)."""

    def __new__(mcs, name: str, bases: tuple[type, ...], attrs: dict[str, Any]) -> ModelMeta:
        attrs.setdefault("_no_comments", True)
        return super().__new__(mcs, name, bases, attrs)


class Model(TortoiseModel, metaclass=_WithoutSourceComments):
    """The base of the host's tables: a tortoise model that is made without reading its source."""

    class Meta:
        abstract = True


# The unique index every lookup of an inventory entry by address uses (``certlm.inventory.entries.find_entry_at``).
SERVER_KEY_UNIQUE = ("server_key", "port", "protocol")


class SchemaVersion(Model):
    """One row: the schema version this database has been migrated to."""

    id = fields.IntField(primary_key=True)
    version = fields.IntField()
    updated_at = fields.DatetimeField(auto_now=True)

    class Meta:
        table = "certlm_schema"


class PluginSchemaVersion(Model):
    """Per plugin that declares migration steps (``certlm_provide_migrations``): the last of its steps applied."""

    plugin = fields.CharField(max_length=100, primary_key=True)
    version = fields.IntField()
    updated_at = fields.DatetimeField(auto_now=True)

    class Meta:
        table = "certlm_plugin_schema"


class SystemSettings(Model):
    """One row (id 1): scheduler and listing settings changed through ``POST /systeminfo``."""

    id = fields.IntField(primary_key=True)
    gds_push_scheduler_active = fields.BooleanField(default=False)
    gds_push_scheduler_renewal_days = fields.IntField(default=30)
    gds_push_scheduler_scan_interval_sec = fields.IntField(default=3600)
    gds_push_scheduler_status = fields.CharField(max_length=64, default="stopped")
    monitor_scheduler_active = fields.BooleanField(default=False)
    monitor_scheduler_scan_interval_sec = fields.IntField(default=3600)
    monitor_scheduler_status = fields.CharField(max_length=64, default="stopped")
    show_inactive_devices = fields.BooleanField(default=False)
    # The last TOTP time step accepted by DELETE /sql, so that one code cannot be used twice.
    last_totp_counter = fields.BigIntField(default=0)
    updated_at = fields.DatetimeField(auto_now=True)

    class Meta:
        table = "system_settings"


class StoredLicense(Model):
    """The installed license file, as uploaded (id 1), and the one it replaced (id 2, ``certlm.system.licensing``),
    which
    ``POST /systeminfo/lic/restore`` puts back."""

    id = fields.IntField(primary_key=True)
    license_b64 = fields.TextField()
    installed_at = fields.DatetimeField(auto_now=True)

    class Meta:
        table = "license"


class TlsServerCertificate(Model):
    """The API server's own TLS certificate. ``pending`` ones become active at the next start."""

    id = fields.IntField(primary_key=True)
    certificate_pem = fields.TextField()
    chain_pem = fields.TextField(default="")
    private_key_enc = fields.TextField()
    pending = fields.BooleanField(default=True)
    uploaded_at = fields.DatetimeField(auto_now_add=True)

    class Meta:
        table = "tls_server_certificate"


class PkiEntry(Model):
    """A configured PKI endpoint; its ``pki_type`` picks the backend plugin."""

    id = fields.IntField(primary_key=True)
    name = fields.CharField(max_length=255, null=True)
    pki_type = fields.IntField()
    pki_connection = fields.CharField(max_length=512)
    username = fields.CharField(max_length=255, null=True)
    password_enc = fields.TextField(null=True)
    additional_path_segment = fields.CharField(max_length=255, null=True)
    est_client_pkcs12_enc = fields.TextField(null=True)
    est_client_pkcs12_password_enc = fields.TextField(null=True)
    est_client_certificate_der = fields.BinaryField(null=True)
    est_cdp_urls = fields.JSONField(default=list)
    tls_cdp_urls = fields.JSONField(default=list)
    tls_ca = fields.JSONField(default=list)
    tls_crls = fields.JSONField(default=list)
    # CA certificates fetched from the PKI (EST /cacerts, CMP genm or an enrollment's caPubs/extraCerts), PEM.
    ca_certificates = fields.JSONField(default=list)
    # Origins (scheme://host:port) other than pki_connection's the server may redirect to; credentials and client
    # certificates meant for pki_connection are never sent there.
    redirect_origins = fields.JSONField(default=list)
    # Refuse, instead of reporting, an issued certificate that lacks a DNS or IP name certlm requested.
    require_requested_names = fields.BooleanField(default=False)
    # What certlm learned about the server by using it (CMP: which message types it accepts or refuses, and why).
    learned_capabilities = fields.JSONField(default=dict)
    # CMP only: the MAC identifiers to protect with ("rfc9481-hmac-sha256", "rfc4210-hmac-sha1"); null negotiates.
    cmp_mac_algorithm = fields.CharField(max_length=32, null=True)
    # The operator's permission for certlm to make a device's key pair and push it, when the PKI certifies no key
    # the device made itself (a CMP server refusing p10cr, without an RA credential for cr with raVerified).
    allow_certlm_generated_keys = fields.BooleanField(default=False)
    creator_id = fields.CharField(max_length=255, null=True)
    created_at = fields.DatetimeField(auto_now_add=True)
    updated_at = fields.DatetimeField(auto_now=True)

    class Meta:
        table = "pki_entry"


class InventoryEntry(Model):
    """A managed device endpoint. ``protocol`` is the inventory table (gds, opc, ssh, rest); ``service`` names
    the driver plugin that talks to it."""

    id = fields.IntField(primary_key=True)
    protocol = fields.CharField(max_length=16, db_index=True)
    service = fields.CharField(max_length=128)
    name = fields.CharField(max_length=255, null=True)
    server = fields.CharField(max_length=255)
    # ``server`` in lower case, set on every save: lookups by address compare it through its unique index, which a
    # case-insensitive comparison of ``server`` cannot use.
    server_key = fields.CharField(max_length=255)
    port = fields.IntField(default=4840)
    device_status = fields.IntField(default=1)
    pki: fields.ForeignKeyNullableRelation[PkiEntry] = fields.ForeignKeyField(
        "models.PkiEntry", related_name="devices", null=True, on_delete=fields.SET_NULL
    )
    security_policy = fields.IntField(null=True)
    security_mode = fields.IntField(null=True)
    renewal_days = fields.IntField(null=True)
    certificate_der = fields.BinaryField(null=True)
    # The device certificate certlm trusts for this entry: pinned at an operator's first contact, replaced by each
    # certificate a push installs or an explicit re-onboarding. Unlike ``certificate_der`` (what monitoring last
    # read) it never follows what a device merely presents.
    pinned_certificate_der = fields.BinaryField(null=True)
    cert_revoked = fields.BooleanField(null=True)
    # The last revocation check of ``certificate_der`` (``certlm.pki.revocation``): its
    # ``certlm.foundation.crl_status`` id and, when
    # revoked, the RFC 5280 reason id; null when not checked. ``cert_revoked`` is what the status says.
    cert_revocation_status = fields.IntField(null=True)
    cert_revocation_reason = fields.IntField(null=True)
    last_changed_certificate_date = fields.DatetimeField(null=True)
    trustlist = fields.JSONField(null=True)
    firmware_version = fields.CharField(max_length=255, null=True)
    device_name = fields.CharField(max_length=255, null=True)
    # The last outcome of each device operation, by operation ("push", "onboarding", "monitor_certificate", ...).
    last_result = fields.JSONField(null=True)
    # What the device said about itself when its driver was chosen: {"identity": {...}, "capabilities": {...}}.
    device_description = fields.JSONField(null=True)
    created_at = fields.DatetimeField(auto_now_add=True)
    updated_at = fields.DatetimeField(auto_now=True)

    class Meta:
        table = "inventory_entry"
        unique_together = (("server", "port", "protocol"), SERVER_KEY_UNIQUE)

    async def save(
        self,
        using_db: BaseDBAsyncClient | None = None,
        update_fields: Iterable[str] | None = None,
        force_create: bool = False,
        force_update: bool = False,
    ) -> None:
        self.server_key = self.server.lower()
        if update_fields is not None and "server" in update_fields:
            update_fields = [*update_fields, "server_key"]
        await super().save(using_db, update_fields, force_create, force_update)


class DeviceSchedule(Model):
    """What the schedulers keep about one inventory entry, and the lease that lets one certlm instance at a time
    operate on the device (``certlm.lifecycle.leases``). Kept apart from ``InventoryEntry`` so that saving an entry
    never
    overwrites a lease another instance holds."""

    id = fields.IntField(primary_key=True)
    entry: fields.OneToOneRelation[InventoryEntry] = fields.OneToOneField(
        "models.InventoryEntry", related_name="schedule", on_delete=fields.CASCADE
    )
    lease_holder = fields.CharField(max_length=128, null=True)
    lease_until = fields.DatetimeField(null=True)
    # Automated renewals that failed in a row, and when the next may start.
    renewal_failures = fields.IntField(default=0)
    renewal_retry_at = fields.DatetimeField(null=True)
    # A renewal whose new certificate was due at once: why, and the configuration it was found under.
    renewal_config_error = fields.TextField(null=True)
    renewal_config_key = fields.CharField(max_length=255, null=True)
    # The monitor: when the device last answered, since when and why it does not.
    last_seen = fields.DatetimeField(null=True)
    unreachable_since = fields.DatetimeField(null=True)
    unreachable_reason = fields.TextField(null=True)
    # When the monitor found the device presenting a certificate certlm did not install; cleared by an operator's
    # push or onboarding.
    certificate_changed_at = fields.DatetimeField(null=True)
    # When a driver found the device's management channel presenting another identity than the pinned one (an SSH
    # host key, a REST TLS certificate), and its message naming both; cleared when an operator re-pins.
    identity_changed_at = fields.DatetimeField(null=True)
    identity_changed_reason = fields.TextField(null=True)
    # When a monitor scan last claimed the device: instances sharing the database read each device once a scan.
    monitored_at = fields.DatetimeField(null=True)
    updated_at = fields.DatetimeField(auto_now=True)

    class Meta:
        table = "device_schedule"


class DeviceCredential(Model):
    """The user identity certlm presents to one device. Deleted with its entry."""

    id = fields.IntField(primary_key=True)
    entry: fields.OneToOneRelation[InventoryEntry] = fields.OneToOneField(
        "models.InventoryEntry", related_name="credential", on_delete=fields.CASCADE
    )
    username = fields.CharField(max_length=255, null=True)
    password_enc = fields.TextField(null=True)
    pkcs12_enc = fields.TextField(null=True)
    pkcs12_password_enc = fields.TextField(null=True)
    updated_at = fields.DatetimeField(auto_now=True)

    class Meta:
        table = "device_credential"


class CaCertificate(Model):
    """A CA certificate kept in the service's own CA store (the ``ca`` table of ``/inventory``)."""

    id = fields.IntField(primary_key=True)
    name = fields.CharField(max_length=255, null=True)
    certificate_pem = fields.TextField()
    sha1_fingerprint = fields.CharField(max_length=64, unique=True)
    subject_dn = fields.TextField()
    created_at = fields.DatetimeField(auto_now_add=True)

    class Meta:
        table = "ca_certificate"


class BackupRecord(Model):
    """One backup, taken by the schedule of any instance on this database or by ``certlm backup``: what
    ``GET /systeminfo`` reports as the last backup, the same for every instance."""

    id = fields.IntField(primary_key=True)
    taken_at = fields.DatetimeField(db_index=True)
    taken_by = fields.CharField(max_length=32)  # BACKUP_BY_SCHEDULE or BACKUP_BY_COMMAND
    ok = fields.BooleanField()
    size = fields.BigIntField(null=True)
    # The archive and its SFTP copy: paths and user@host, shown only to a caller with the API key.
    locations = fields.JSONField(default=list)
    error = fields.TextField(null=True)

    class Meta:
        table = "backup_record"


class NamedApiKey(Model):
    """A key made with ``POST /apikeys`` (``certlm.system.apikeys``): its name, role and expiry, and the key only as
    its SHA-256 (the key is 256 random bits, so a plain hash is as good as a slow one and costs nothing per request).
    Deleting the row revokes the key on every instance at once: each request looks its key up."""

    id = fields.IntField(primary_key=True)
    name = fields.CharField(max_length=64, unique=True)
    role = fields.CharField(max_length=16)
    key_sha256 = fields.CharField(max_length=64, unique=True)
    expires_at = fields.DatetimeField(null=True)
    created_at = fields.DatetimeField(auto_now_add=True)
    created_by = fields.CharField(max_length=80)

    class Meta:
        table = "named_api_key"


class Campaign(Model):
    """A fleet campaign (``certlm.lifecycle.campaigns``): the devices in ``scope`` move from the issuer of PKI entry
    ``from_pki_id`` to that of ``to_pki_id`` (the same entry for a rekey), trust first."""

    id = fields.IntField(primary_key=True)
    kind = fields.CharField(max_length=16)
    state = fields.CharField(max_length=16, default="running")
    phase = fields.CharField(max_length=16, default="trust")
    from_pki_id = fields.IntField()
    to_pki_id = fields.IntField()
    scope = fields.JSONField()
    deadline = fields.DatetimeField(null=True)
    concurrency = fields.IntField()
    respect_windows = fields.BooleanField(default=True)
    # The devices the operator accepted to go on without in the trust phase (their entry ids).
    exceptions = fields.JSONField(default=list)
    # The new issuer's CAs whose CRL the operator accepted to go on without (``{"sha1", "subject"}`` each): the
    # reissue does not wait for their CRLs.
    crl_waivers = fields.JSONField(default=list)
    # The certificate of the new issuing CA certlm asked the PKI for to learn where that CA publishes its CRL (its key
    # dropped), PEM, while the campaign holds it; "" when it holds none. Kept here so a restart does not forget it. Let
    # go of, it becomes a ``CrlProbeRevocation`` until the PKI confirms the revocation.
    crl_probe_pem = fields.TextField(default="")
    # The issuers' CA chains (PEM) and CRLs (PEM) as they were when the campaign was made.
    old_issuer_pem = fields.TextField()
    new_issuer_pem = fields.TextField()
    new_crls_pem = fields.TextField(default="")
    old_crls_pem = fields.TextField(default="")
    # What keeps the campaign from its next phase, in a sentence; None when nothing does.
    blocked = fields.TextField(null=True)
    # While the reissue waits for CRLs of the new issuer (``blocked`` says so), each CA it lacks one of
    # (``{"subject", "sha1", "problem"}``); empty otherwise.
    crls_missing = fields.JSONField(default=list)
    # The CRL probe certificates certlm gave up revoking (``{"serial", "pki_id", "error", "since"}`` each): the PKI
    # refused or could not be reached for ``PROBE_REVOCATION_GIVE_UP``, or cannot revoke at all. The operator's to
    # revoke by hand; kept for as long as the campaign is.
    crl_probe_unrevoked = fields.JSONField(default=list)
    created_at = fields.DatetimeField(auto_now_add=True)
    updated_at = fields.DatetimeField(auto_now=True)

    devices: fields.ReverseRelation[CampaignDevice]

    class Meta:
        table = "campaign"


class CampaignDevice(Model):
    """One device of a campaign: the state of each of its phases (``pending``, ``done``, ``failed``, ``unverified``,
    ``excepted``) and its last step."""

    id = fields.IntField(primary_key=True)
    campaign: fields.ForeignKeyRelation[Campaign] = fields.ForeignKeyField(
        "models.Campaign", related_name="devices", on_delete=fields.CASCADE
    )
    entry: fields.ForeignKeyRelation[InventoryEntry] = fields.ForeignKeyField(
        "models.InventoryEntry", related_name="campaign_devices", on_delete=fields.CASCADE
    )
    trust = fields.CharField(max_length=16, default="pending")
    reissue = fields.CharField(max_length=16, default="pending")
    retire = fields.CharField(max_length=16, default="pending")
    last_step = fields.JSONField(null=True)
    attempts = fields.IntField(default=0)
    next_try_at = fields.DatetimeField(null=True)
    updated_at = fields.DatetimeField(auto_now=True)

    class Meta:
        table = "campaign_device"
        unique_together = (("campaign", "entry"),)


class CrlProbeRevocation(Model):
    """A CRL probe certificate a campaign let go of (``certlm.lifecycle.campaigns``) and certlm has yet to see
    revoked: the row stays until the PKI confirms the revocation, so one the PKI was unreachable for is tried again
    (``next_try_at``), not forgotten."""

    id = fields.IntField(primary_key=True)
    campaign_id = fields.IntField()
    # The PKI entry that issued it (the campaign's ``to_pki_id``).
    pki_id = fields.IntField()
    serial = fields.CharField(max_length=64)
    certificate_pem = fields.TextField()
    attempts = fields.IntField(default=0)
    # When it is tried again; an instance trying it moves this ahead first (a conditional UPDATE), so one tries.
    next_try_at = fields.DatetimeField()
    last_error = fields.TextField(null=True)
    created_at = fields.DatetimeField(auto_now_add=True)

    class Meta:
        table = "crl_probe_revocation"


class MaintenanceWindow(Model):
    id = fields.IntField(primary_key=True)
    name = fields.CharField(max_length=255)
    description = fields.TextField(null=True)
    status = fields.CharField(max_length=16)
    window_type = fields.CharField(max_length=16)
    timezone = fields.CharField(max_length=64, default="Europe/Berlin")
    valid_from = fields.DatetimeField(null=True)
    valid_until = fields.DatetimeField(null=True)
    created_at = fields.DatetimeField(auto_now_add=True)
    updated_at = fields.DatetimeField(auto_now=True)

    rules: fields.ReverseRelation[MaintenanceRule]

    class Meta:
        table = "maintenance_window"


class MaintenanceRule(Model):
    id = fields.IntField(primary_key=True)
    window: fields.ForeignKeyRelation[MaintenanceWindow] = fields.ForeignKeyField(
        "models.MaintenanceWindow", related_name="rules", on_delete=fields.CASCADE
    )
    start_at = fields.DatetimeField(null=True)
    end_at = fields.DatetimeField(null=True)
    recurrence_type = fields.CharField(max_length=16, null=True)
    day_of_week = fields.IntField(null=True)
    day_of_month = fields.IntField(null=True)
    start_time = fields.CharField(max_length=8, null=True)
    end_time = fields.CharField(max_length=8, null=True)
    interval_count = fields.IntField(null=True)
    rrule = fields.TextField(null=True)
    # Extensions to the spec's rule fields: the expression of a "cron" rule, and how long a window opened
    # by a cron or RRULE occurrence stays open.
    cron = fields.CharField(max_length=255, null=True)
    duration_minutes = fields.IntField(null=True)
    created_at = fields.DatetimeField(auto_now_add=True)
    updated_at = fields.DatetimeField(auto_now=True)

    class Meta:
        table = "maintenance_rule"


class RowIdField(fields.BigIntField):
    """A 64-bit primary key that SQLite keeps as the table's rowid (``INTEGER PRIMARY KEY``): the table is the one
    B-tree of its ids, where ``BIGINT PRIMARY KEY`` makes SQLite keep an index of them beside it. PostgreSQL: BIGINT."""

    class _db_sqlite:
        SQL_TYPE = "INTEGER"


class IndexOfGiven(Index):
    """An index of one column over the rows where it is not NULL only (a partial index; SQLite and PostgreSQL): a row
    without a value writes nothing to it, and a filter on a value of the column still uses it. tortoise's
    ``PartialIndex`` knows only ``column = value`` conditions."""

    def __init__(self, column: str, name: str) -> None:
        super().__init__(fields=(column,), name=name)
        self.extra = f' WHERE "{column}" IS NOT NULL'


class AuditRecord(Model):
    """One record of the audit trail (``certlm.system.audit``): who did what to which target, when, with what outcome
    and which fields changed. Never updated: each carries the SHA-256 of the record before it (``prev_hash``) and its
    own over its fields (``hash``). The appender gives the id (the head's plus one, under the chain's lock), so ids
    have no gaps and a removed record shows."""

    # Every request that changes state writes one: each index is one more B-tree to write. Only the device filters
    # (the dashboard's device history) have one, over the records that name an entry or a device (``Meta.indexes``):
    # a record of no device (a maintenance window, a key) writes no index. The other filters (time, actor, action)
    # read on from ``after_id`` in id order, page by page, which ids already give.
    id = RowIdField(primary_key=True, generated=False)
    at = fields.DatetimeField()
    actor = fields.CharField(max_length=255)
    actor_kind = fields.CharField(max_length=16)
    role = fields.CharField(max_length=16, null=True)
    source = fields.CharField(max_length=64, null=True)
    action = fields.CharField(max_length=255)
    target = fields.TextField(null=True)
    entry_id = fields.IntField(null=True)
    device = fields.CharField(max_length=300, null=True)
    status = fields.IntField(null=True)
    outcome = fields.CharField(max_length=16)
    detail = fields.TextField(null=True)
    # The changed fields as canonical JSON text: hashed as stored, whatever a database does to JSON values.
    changes = fields.TextField(default="[]")
    prev_hash = fields.CharField(max_length=64)
    hash = fields.CharField(max_length=64)

    class Meta:
        table = "audit_record"
        indexes = (
            IndexOfGiven("entry_id", "idx_audit_record_entry_id_given"),
            IndexOfGiven("device", "idx_audit_record_device_given"),
        )


class AuditChainStart(Model):
    """One row (id 1) once retention dropped a prefix of the audit trail: the last dropped record's id and hash, which
    the first kept record's ``prev_hash`` must equal."""

    id = fields.IntField(primary_key=True)
    last_dropped_id = fields.BigIntField()
    last_dropped_hash = fields.CharField(max_length=64)
    dropped_at = fields.DatetimeField()

    class Meta:
        table = "audit_chain_start"


class RejectedClient(Model):
    """A client certificate a device refused and listed (OPC UA GetRejectedList), as the monitor found it
    (``certlm.lifecycle.rejected``): one row per device and certificate. ``entry_id`` is no foreign key: the record
    outlives a deleted entry (``device`` keeps its address), and an approval then says the device is gone.
    ``state`` is ``waiting``, ``approved`` or ``dismissed``; ``trusted`` what an approval added to the trust list."""

    id = fields.IntField(primary_key=True)
    entry_id = fields.IntField(db_index=True)
    device = fields.CharField(max_length=512)
    fingerprint = fields.CharField(max_length=64)
    certificate_der = fields.BinaryField()
    subject = fields.TextField()
    issuer = fields.TextField()
    application_uri = fields.TextField(null=True)
    first_seen = fields.DatetimeField()
    last_seen = fields.DatetimeField()
    # Whether the device listed it at its last read of the list.
    listed = fields.BooleanField(default=True)
    state = fields.CharField(max_length=16, default="waiting", db_index=True)
    decided_by = fields.CharField(max_length=80, null=True)
    decided_at = fields.DatetimeField(null=True)
    trusted = fields.JSONField(null=True)

    class Meta:
        table = "rejected_client"
        unique_together = (("entry_id", "fingerprint"),)
