"""The GDS push plugin's table: certlm's own OPC UA client application instance certificate and key."""

from __future__ import annotations

from tortoise import fields
from tortoise.models import Model


class OpcUaClientIdentity(Model):
    """The one application instance certificate certlm presents to devices; the key only as a SecretBox token."""

    id = fields.IntField(primary_key=True)
    application_uri = fields.CharField(max_length=512)
    certificate_der = fields.BinaryField()
    # The issuer chain (DER certificates, issuing CA first), empty for a self-signed certificate.
    chain_der = fields.JSONField(default=list)
    private_key_enc = fields.TextField()
    created_at = fields.DatetimeField(auto_now_add=True)

    class Meta:
        table = "gds_push_client_identity"
