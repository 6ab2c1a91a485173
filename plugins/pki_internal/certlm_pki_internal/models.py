"""The internal CA's tables: one root CA per internal PKI entry, and the certificates it issued and revoked.

The CA private key is stored only as a SecretBox token, in a field whose name ends in ``_enc`` like the host's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tortoise import fields
from tortoise.models import Model

if TYPE_CHECKING:
    # Only for annotations: tortoise collects every model found in this module's namespace.
    from certlm import PkiEntry


class InternalCa(Model):
    """The root CA of one internal PKI entry, created on first use and deleted with the entry."""

    id = fields.IntField(primary_key=True)
    pki_entry: fields.OneToOneRelation[PkiEntry] = fields.OneToOneField(
        "models.PkiEntry", related_name="internal_ca", on_delete=fields.CASCADE
    )
    certificate_pem = fields.TextField()
    private_key_enc = fields.TextField()
    # The number the next CRL gets; RFC 5280 requires CRL numbers to increase monotonically.
    next_crl_number = fields.BigIntField(default=1)
    # The CRL served until it is due for refresh or a revocation makes it stale (then both are cleared).
    crl_der = fields.BinaryField(null=True)
    crl_last_update = fields.DatetimeField(null=True)
    created_at = fields.DatetimeField(auto_now_add=True)

    issued: fields.ReverseRelation[IssuedCertificate]

    class Meta:
        table = "pki_internal_ca"


class IssuedCertificate(Model):
    """A certificate the CA signed; revoked ones (``revoked_at`` set) go on its CRL until they expire."""

    id = fields.IntField(primary_key=True)
    ca: fields.ForeignKeyRelation[InternalCa] = fields.ForeignKeyField(
        "models.InternalCa", related_name="issued", on_delete=fields.CASCADE
    )
    # Upper-case hex: random 159-bit serials do not fit a database integer.
    serial_number = fields.CharField(max_length=64)
    subject_dn = fields.TextField()
    profile = fields.CharField(max_length=16)
    not_valid_after = fields.DatetimeField()
    issued_at = fields.DatetimeField(auto_now_add=True)
    revoked_at = fields.DatetimeField(null=True)
    revocation_reason = fields.CharField(max_length=32, null=True)

    class Meta:
        table = "pki_internal_issued_certificate"
        unique_together = (("ca", "serial_number"),)
