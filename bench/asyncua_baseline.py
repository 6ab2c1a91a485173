"""The push benchmark's baseline: what a plain asyncua script spends on one Part 12 push, with nothing of certlm.

One push is what certlm's onboarding does, in the same order: connect SignAndEncrypt as the admin user,
CreateSigningRequest, sign the CSR with a CA made here, write the trust list (Open, Write, CloseAndUpdate: the CA, a CRL
of it and this client's certificate, as a strict device demands), UpdateCertificate, ApplyChanges; then reconnect
until the device presents the new certificate. Two sessions, each set up the way asyncua's examples do it
(``Client.set_security`` asks for the endpoints and loads the client's key and certificate).

    .venv/bin/python bench/asyncua_baseline.py opc.tcp://127.0.0.1:48410 [more URLs]
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from asyncua import Client, ua
from asyncua.crypto.security_policies import SecurityPolicyBasic256Sha256
from asyncua.ua.ua_binary import struct_to_binary
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

APPLICATION_URI = f"urn:{socket.gethostname()}:asyncua-baseline"
ADMIN_USER, ADMIN_PASSWORD = "admin", "admin-pw"
CA_KEY_BITS = 3072  # as certlm's internal CA
GROUP = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup)
CERTIFICATE_TYPE = ua.NodeId(ua.ObjectIds.RsaSha256ApplicationCertificateType)
TRUST_LIST = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList)
TRUST_LIST_METHOD = "ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList_{}"
VERIFY_POLL_S = 0.05


def _der(item: x509.Certificate | x509.CertificateRevocationList) -> bytes:
    return item.public_bytes(serialization.Encoding.DER)


@dataclass(frozen=True)
class BaselineCa:
    """A root CA with its CRL, and this script's self-signed client application certificate."""

    key: rsa.RSAPrivateKey
    certificate: x509.Certificate
    crl: x509.CertificateRevocationList
    client_certificate_der: bytes
    client_key_der: bytes

    @classmethod
    def create(cls) -> BaselineCa:
        now = datetime.now(UTC)
        key = rsa.generate_private_key(public_exponent=65537, key_size=CA_KEY_BITS)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "asyncua baseline CA")])
        certificate = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        crl = (
            x509.CertificateRevocationListBuilder().issuer_name(name).last_update(now - timedelta(minutes=5))
            .next_update(now + timedelta(days=7)).add_extension(x509.CRLNumber(1), critical=False)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        client_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        client_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "asyncua baseline client")])
        client_certificate = (
            x509.CertificateBuilder().subject_name(client_name).issuer_name(client_name)
            .public_key(client_key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(APPLICATION_URI),
                                                        x509.DNSName(socket.gethostname())]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]),
                           critical=False)
            .sign(client_key, hashes.SHA256())
        )  # fmt: skip
        client_key_der = client_key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cls(key, certificate, crl, _der(client_certificate), client_key_der)

    def sign(self, csr: x509.CertificateSigningRequest) -> x509.Certificate:
        """A certificate for the device's CSR key, naming what the CSR names."""
        assert csr.is_signature_valid
        now = datetime.now(UTC)
        builder = (
            x509.CertificateBuilder().subject_name(csr.subject).issuer_name(self.certificate.subject)
            .public_key(csr.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=365))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(ca=False), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )  # fmt: skip
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return builder.add_extension(san, critical=False).sign(self.key, hashes.SHA256())

    def trust_list(self) -> bytes:
        """The TrustList file content: the CA, its CRL and this client's certificate, which the device must keep."""
        data = ua.TrustListDataType(
            SpecifiedLists=ua.TrustListMasks.TrustedCertificates | ua.TrustListMasks.TrustedCrls,
            TrustedCertificates=[_der(self.certificate), self.client_certificate_der],
            TrustedCrls=[_der(self.crl)],
        )
        return struct_to_binary(data)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True, content_commitment=not ca, key_encipherment=not ca, data_encipherment=not ca,
        key_agreement=False, key_cert_sign=ca, crl_sign=ca, encipher_only=False, decipher_only=False,
    )  # fmt: skip


async def secure_client(url: str, ca: BaselineCa, server_certificate: bytes | None = None) -> Client:
    """A SignAndEncrypt client as the admin user, set up as asyncua's examples do (without ``server_certificate``,
    ``set_security`` asks the device's endpoints for it)."""
    client = Client(url)
    client.application_uri = APPLICATION_URI
    await client.set_security(
        SecurityPolicyBasic256Sha256,
        ca.client_certificate_der,
        ca.client_key_der,
        server_certificate=server_certificate,
        mode=ua.MessageSecurityMode.SignAndEncrypt,
    )
    client.set_user(ADMIN_USER)
    client.set_password(ADMIN_PASSWORD)
    return client


async def push(url: str, ca: BaselineCa) -> None:
    """One push to the device at ``url``: raises when the device does not present the issued certificate."""
    client = await secure_client(url, ca)
    async with client:
        configuration = client.get_node(ua.ObjectIds.ServerConfiguration)
        csr_der = await configuration.call_method(
            ua.NodeId(ua.ObjectIds.ServerConfiguration_CreateSigningRequest),
            GROUP, CERTIFICATE_TYPE, "", True, os.urandom(32),
        )  # fmt: skip
        issued = ca.sign(x509.load_der_x509_csr(csr_der))
        trust_list = client.get_node(TRUST_LIST)
        handle = await trust_list.call_method(
            ua.NodeId(getattr(ua.ObjectIds, TRUST_LIST_METHOD.format("Open"))),
            ua.Variant(ua.OpenFileMode.Write | ua.OpenFileMode.EraseExisting, ua.VariantType.Byte),
        )
        handle_argument = ua.Variant(handle, ua.VariantType.UInt32)
        await trust_list.call_method(
            ua.NodeId(getattr(ua.ObjectIds, TRUST_LIST_METHOD.format("Write"))), handle_argument, ca.trust_list()
        )
        await trust_list.call_method(
            ua.NodeId(getattr(ua.ObjectIds, TRUST_LIST_METHOD.format("CloseAndUpdate"))), handle_argument
        )
        await configuration.call_method(
            ua.NodeId(ua.ObjectIds.ServerConfiguration_UpdateCertificate),
            GROUP, CERTIFICATE_TYPE, _der(issued), [_der(ca.certificate)], "", b"",
        )  # fmt: skip
        await configuration.call_method(ua.NodeId(ua.ObjectIds.ServerConfiguration_ApplyChanges))
    await verify(url, ca, issued)


async def verify(url: str, ca: BaselineCa, issued: x509.Certificate, timeout_s: float = 30.0) -> None:
    """Ask the endpoints until the device announces ``issued`` (it reopens them a moment after ApplyChanges), then
    connect with it and read the server state."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            endpoints = await Client(url).connect_and_get_server_endpoints()
        except (ConnectionError, OSError, TimeoutError):
            endpoints = []  # the device dropped the connection as it reopened its endpoints: ask again
        if endpoints:
            endpoint = Client.find_endpoint(
                endpoints, ua.MessageSecurityMode.SignAndEncrypt, SecurityPolicyBasic256Sha256.URI
            )
            if endpoint.ServerCertificate == _der(issued):
                break
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} does not present the issued certificate")
        await asyncio.sleep(VERIFY_POLL_S)
    async with await secure_client(url, ca, endpoint.ServerCertificate) as client:
        await client.get_node(ua.ObjectIds.Server_ServerStatus_State).read_value()


async def main(urls: list[str]) -> None:
    ca = BaselineCa.create()
    started_cpu, started = time.process_time(), time.monotonic()
    await asyncio.gather(*(push(url, ca) for url in urls))
    cpu, wall = time.process_time() - started_cpu, time.monotonic() - started
    print(f"{len(urls)} pushes in {wall:.2f} s; {cpu / len(urls):.4f} s CPU per push")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
