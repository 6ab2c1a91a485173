"""The REST plugin's tables: what certlm keeps about a REST entry beyond the host's inventory row."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from tortoise import fields
from tortoise.models import Model


class RestDevice(Model):
    """The management API's pinned TLS certificate, the bearer token (only as a SecretBox token) and the OPC UA
    endpoint a push verifies the installed certificate on. Deleted with its entry."""

    id = fields.IntField(primary_key=True)
    entry = fields.OneToOneField("models.InventoryEntry", related_name="rest_device", on_delete=fields.CASCADE)
    opcua_url = fields.CharField(max_length=512, null=True)
    bearer_token_enc = fields.TextField(null=True)
    # The TLS certificate the management API presented at the operator's first contact: every later connection must
    # verify against it, and none that does not gets the entry's credentials.
    tls_certificate_der = fields.BinaryField(null=True)
    tls_pinned_at = fields.DatetimeField(null=True)
    updated_at = fields.DatetimeField(auto_now=True)

    class Meta:
        table = "rest_device"


class RestTrustWritten(Model):
    """What certlm wrote to the device's trusted list in its last successful push (SHA-256 hex digests of the DER
    certificates and CRLs). The next push replaces these and keeps every other entry of the device's list, as the SSH
    plugin keeps files it did not write. A table of its own, so that databases from before it get it at start-up
    (new tables are created; the plugin has no migrations for new columns). Deleted with its entry."""

    id = fields.IntField(primary_key=True)
    entry = fields.OneToOneField("models.InventoryEntry", related_name="rest_trust_written", on_delete=fields.CASCADE)
    trusted_certificates = fields.JSONField(default=list)
    trusted_crls = fields.JSONField(default=list)
    updated_at = fields.DatetimeField(auto_now=True)

    class Meta:
        table = "rest_trust_written"


def digests(items: Iterable[bytes]) -> list[str]:
    """The SHA-256 hex digest of each DER item, as ``RestTrustWritten`` stores them."""
    return [hashlib.sha256(item).hexdigest() for item in items]
