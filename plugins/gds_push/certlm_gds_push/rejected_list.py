"""ServerConfiguration.GetRejectedList (OPC UA Part 12): the client certificates a device refused and still lists, so
that an operator can approve one from certlm instead of at the device.

Both devices certlm is tested against answer it only on a SignAndEncrypt channel to an administrator (node-opcua:
the SecurityAdmin role), as the other push management methods. Each entry is a ByteString holding one DER
certificate or, where the device kept the chain the client sent, several concatenated (Part 6): they come out as
certificates in turn.
"""

from __future__ import annotations

import logging

from asyncua import ua
from cryptography import x509
from cryptography.hazmat.primitives import hashes

from certlm import UnsupportedOperation, issued_by, to_der
from certlm_gds_push.connection import DeviceError, DeviceSession, status_name

log = logging.getLogger(__name__)

GET_REJECTED_LIST = ua.NodeId(ua.ObjectIds.ServerConfiguration_GetRejectedList)
# What a device answers when it does not list rejected certificates, or not to certlm's user on this channel.
NOT_OFFERED_STATUSES = frozenset(
    {
        "BadMethodInvalid",
        "BadNodeIdUnknown",
        "BadNotImplemented",
        "BadNotSupported",
        "BadSecurityModeInsufficient",
        "BadUserAccessDenied",
    }
)


async def get_rejected_list(session: DeviceSession, configuration_id: ua.NodeId) -> list[x509.Certificate]:
    """GetRejectedList on the device's ServerConfiguration (``configuration_id``): every certificate it lists, each
    once. ``UnsupportedOperation`` naming the status when the device does not offer it to this session."""
    try:
        outputs = await session.call(configuration_id, GET_REJECTED_LIST)
    except ua.UaStatusCodeError as error:
        status = status_name(error)
        if status in NOT_OFFERED_STATUSES:
            raise UnsupportedOperation(
                f"the device does not list the client certificates it rejected to certlm: GetRejectedList answered "
                f"{status}"
            ) from error
        raise
    blobs = outputs[0] if outputs else None
    certificates: dict[bytes, x509.Certificate] = {}
    for index, blob in enumerate(blobs or []):
        for certificate in _certificates_in(blob, index):
            certificates.setdefault(certificate.fingerprint(hashes.SHA256()), certificate)
    return list(certificates.values())


def _certificates_in(blob: bytes | None, index: int) -> list[x509.Certificate]:
    """The certificates of one entry: DER certificates one after another (Part 6's chain encoding)."""
    found, rest = [], bytes(blob or b"")
    while rest:
        length = _der_length(rest)
        try:
            if length is None or length > len(rest):
                raise ValueError("not a DER SEQUENCE")
            found.append(x509.load_der_x509_certificate(rest[:length]))
        except ValueError:
            raise DeviceError(
                f"GetRejectedList entry {index} is not DER certificates", "BadCertificateInvalid"
            ) from None
        rest = rest[length:]
    return found


def _der_length(data: bytes) -> int | None:
    """The length of the DER SEQUENCE at the start of ``data`` (tag and length octets included), None if it is
    none."""
    if len(data) < 2 or data[0] != 0x30:
        return None
    first = data[1]
    if first < 0x80:
        return 2 + first
    octets = first & 0x7F
    if octets == 0 or octets > 4 or len(data) < 2 + octets:
        return None
    return 2 + octets + int.from_bytes(data[2 : 2 + octets], "big")


ADD_CERTIFICATE = ua.NodeId(
    ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList_AddCertificate
)


async def release_rejected(session: DeviceSession, configuration_id: ua.NodeId, trust_list_id: ua.NodeId,
                           trusted_certificates: list[bytes]) -> None:  # fmt: skip
    """Before a trust list is written: add each certificate the device lists as rejected that the new list trusts,
    itself or through the CA that issued it, with TrustList.AddCertificate. node-opcua refuses a certificate while
    it lies in its ``rejected/`` folder, before it looks at the trust list or the issuer; AddCertificate is the Part 12
    method that moves it out of there. The write that follows then makes the trusted list exactly what it was given
    (a certificate trusted only through its CA leaves node-opcua's trusted folder again, released). A device that
    refuses AddCertificate, or does not list rejected certificates, is left to the write alone."""
    try:
        rejected = await get_rejected_list(session, configuration_id)
    except (UnsupportedOperation, DeviceError, ua.UaStatusCodeError) as error:
        log.debug("%s: rejected list not read before the trust list write: %s", session.client.server_url, error)
        return
    trusted = set(trusted_certificates)
    cas = [x509.load_der_x509_certificate(der) for der in trusted_certificates]
    for certificate in rejected:
        der = to_der(certificate)
        if der not in trusted and not any(issued_by(certificate, ca) for ca in cas if ca != certificate):
            continue
        try:
            await session.call(
                trust_list_id, ADD_CERTIFICATE, ua.Variant(der, ua.VariantType.ByteString), ua.Variant(True)
            )
        except ua.UaStatusCodeError as error:
            log.info("%s: AddCertificate of a rejected certificate: %s", session.client.server_url, status_name(error))
