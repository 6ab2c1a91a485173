"""The SSH plugin's table: what certlm keeps per SSH entry beyond the host's columns: the pinned host key, the private
key certlm authenticates with (a SecretBox token only), the OPC UA endpoint and the entry's layout overrides."""

from __future__ import annotations

from tortoise import fields
from tortoise.models import Model


class SshDeviceSettings(Model):
    """One SSH inventory entry's SSH and OPC UA settings; deleted with the entry."""

    id = fields.IntField(primary_key=True)
    entry = fields.OneToOneField("models.InventoryEntry", related_name="ssh_settings", on_delete=fields.CASCADE)
    # The host key the device presented when an operator pinned it, in OpenSSH public key format.
    host_key = fields.TextField(null=True)
    host_key_pinned_at = fields.DatetimeField(null=True)
    # The OpenSSH or PKCS#8 private key certlm logs in with, and its passphrase: SecretBox tokens.
    private_key_enc = fields.TextField(null=True)
    private_key_passphrase_enc = fields.TextField(null=True)
    # The OPC UA endpoint that must present the installed certificate; None: opc.tcp://<server>:<layout opcua_port>.
    opcua_url = fields.CharField(max_length=512, null=True)
    # The ApplicationUri a new certificate names when the device's current one names none.
    application_uri = fields.CharField(max_length=512, null=True)
    layout = fields.JSONField(default=dict)
    updated_at = fields.DatetimeField(auto_now=True)

    class Meta:
        table = "ssh_device_settings"
