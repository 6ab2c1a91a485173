"""The REST plugin's table: what certlm keeps about a REST entry beyond the host's inventory row."""

from __future__ import annotations

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
