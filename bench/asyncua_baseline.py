"""The push benchmark's baseline: what a plain asyncua script spends on one Part 12 push, with nothing of certlm.

One push does only what a push must, in the order certlm's onboarding does it: GetEndpoints, connect SignAndEncrypt
(Aes256Sha256RsaPss, the policy certlm picks on the simulated devices) as the admin user, CreateSigningRequest, sign
the CSR with a CA made here, write the trust list (Open, Write, CloseAndUpdate: the CA, a CRL of it and this client's
certificate, as a strict device demands), UpdateCertificate, ApplyChanges; then, after the time the simulated device
takes to reopen its endpoints (``APPLY_SETTLE_S``, as certlm's driver for it waits), GetEndpoints again until the
device presents the new certificate, and a second session with it to check that it works (reading the server state).

The script is as lean as a careful author writes it: the client's key and certificate are parsed once, at start, and
each session's security policy is built from the parsed objects and the certificate the device announces in
GetEndpoints (asyncua's ``Client.set_security``, as its examples use it, parses the key from bytes for every session:
cryptography checks an RSA key's math on each load, tens of ms of CPU); the trust list is encoded once. Key sizes are
certlm's: the CA RSA 3072, the client RSA 2048, the device's key the device's own.

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
from asyncua.crypto.security_policies import SecurityPolicyAes256Sha256RsaPss
from asyncua.ua.ua_binary import struct_to_binary
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

APPLICATION_URI = f"urn:{socket.gethostname()}:asyncua-baseline"
ADMIN_USER, ADMIN_PASSWORD = "admin", "admin-pw"
CA_KEY_BITS = 3072  # as certlm's internal CA
CLIENT_KEY_BITS = 2048  # as certlm's OPC UA client
POLICY = SecurityPolicyAes256Sha256RsaPss
# asyncua reads the server state every second of a session by default (its watchdog), an encrypted round trip
# that fails a busy device's session; certlm's driver turns it off (plugins/gds_push connection.py), and so does the
# script: both sides do only what a push must.
WATCHDOG_OFF_S = 600
SESSIONS_PER_PUSH = 2  # the push, and the check with the new certificate
GROUP = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup)
CERTIFICATE_TYPE = ua.NodeId(ua.ObjectIds.RsaSha256ApplicationCertificateType)
TRUST_LIST = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList)
TRUST_LIST_METHOD = "ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList_{}"
VERIFY_POLL_S = 0.05
# The simulated device reopens its endpoints this long after ApplyChanges (certlm-simulate's default --apply-delay,
# and what certlm's driver for it waits before it checks): a session before that meets the channel about to drop.
APPLY_SETTLE_S = 0.5


def _der(item: x509.Certificate | x509.CertificateRevocationList) -> bytes:
    return item.public_bytes(serialization.Encoding.DER)


@dataclass(frozen=True)
class BaselineCa:
    """A root CA with its CRL, and this script's self-signed client application certificate with its key, parsed
    once; the trust list every push writes, encoded once."""

    key: rsa.RSAPrivateKey
    certificate: x509.Certificate
    crl: x509.CertificateRevocationList
    client_certificate: x509.Certificate
    client_key: rsa.RSAPrivateKey
    trust_list: bytes

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
        client_key = rsa.generate_private_key(public_exponent=65537, key_size=CLIENT_KEY_BITS)
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
        # The TrustList file content: the CA, its CRL and this client's certificate, which the device must keep.
        trust_list = ua.TrustListDataType(
            SpecifiedLists=ua.TrustListMasks.TrustedCertificates | ua.TrustListMasks.TrustedCrls,
            TrustedCertificates=[_der(certificate), _der(client_certificate)],
            TrustedCrls=[_der(crl)],
        )
        return cls(key, certificate, crl, client_certificate, client_key, struct_to_binary(trust_list))

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


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True, content_commitment=not ca, key_encipherment=not ca, data_encipherment=not ca,
        key_agreement=False, key_cert_sign=ca, crl_sign=ca, encipher_only=False, decipher_only=False,
    )  # fmt: skip


async def endpoint_presenting(
    url: str, presenting: bytes | None = None, timeout_s: float = 30.0
) -> ua.EndpointDescription:
    """The device's SignAndEncrypt endpoint of ``POLICY`` (GetEndpoints), asked again until it presents
    ``presenting`` (DER; None: whatever it presents): a device reopens its endpoints a moment after ApplyChanges."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            endpoints = await Client(url).connect_and_get_server_endpoints()
        except (ConnectionError, OSError, TimeoutError):
            endpoints = []  # the device dropped the connection as it reopened its endpoints: ask again
        if endpoints:
            endpoint = Client.find_endpoint(endpoints, ua.MessageSecurityMode.SignAndEncrypt, POLICY.URI)
            if presenting is None or endpoint.ServerCertificate == presenting:
                return endpoint
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} does not present the issued certificate")
        await asyncio.sleep(VERIFY_POLL_S)


def secure_client(url: str, ca: BaselineCa, endpoint: ua.EndpointDescription) -> Client:
    """A SignAndEncrypt client as the admin user for the device's ``endpoint``, its policy built from the client's
    key and certificate as parsed once (``BaselineCa``)."""
    client = Client(url, watchdog_intervall=WATCHDOG_OFF_S)
    client.application_uri = APPLICATION_URI
    client.security_policy = POLICY(
        x509.load_der_x509_certificate(endpoint.ServerCertificate), ca.client_certificate, ca.client_key,
        ua.MessageSecurityMode.SignAndEncrypt,
    )  # fmt: skip
    client.uaclient.set_security(client.security_policy)
    client.set_user(ADMIN_USER)
    client.set_password(ADMIN_PASSWORD)
    return client


async def push(url: str, ca: BaselineCa) -> None:
    """One push to the device at ``url``: raises when the device does not present the issued certificate."""
    async with secure_client(url, ca, await endpoint_presenting(url)) as client:
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
            ua.NodeId(getattr(ua.ObjectIds, TRUST_LIST_METHOD.format("Write"))), handle_argument, ca.trust_list
        )
        await trust_list.call_method(
            ua.NodeId(getattr(ua.ObjectIds, TRUST_LIST_METHOD.format("CloseAndUpdate"))), handle_argument
        )
        await configuration.call_method(
            ua.NodeId(ua.ObjectIds.ServerConfiguration_UpdateCertificate),
            GROUP, CERTIFICATE_TYPE, _der(issued), [_der(ca.certificate)], "", b"",
        )  # fmt: skip
        await configuration.call_method(ua.NodeId(ua.ObjectIds.ServerConfiguration_ApplyChanges))
    await asyncio.sleep(APPLY_SETTLE_S)
    await verify(url, ca, issued)


async def verify(url: str, ca: BaselineCa, issued: x509.Certificate) -> None:
    """Ask the endpoints until the device announces ``issued`` (it reopens them a moment after ApplyChanges), then
    connect with it and read the server state."""
    endpoint = await endpoint_presenting(url, _der(issued))
    async with secure_client(url, ca, endpoint) as client:
        await client.get_node(ua.ObjectIds.Server_ServerStatus_State).read_value()


async def empty_session(url: str, ca: BaselineCa) -> None:
    """One of the script's sessions with nothing in it: GetEndpoints, open the secure session, close it."""
    async with secure_client(url, ca, await endpoint_presenting(url)):
        pass


async def main(urls: list[str]) -> None:
    ca = BaselineCa.create()
    started_cpu, started = time.process_time(), time.monotonic()
    await asyncio.gather(*(push(url, ca) for url in urls))
    cpu, wall = time.process_time() - started_cpu, time.monotonic() - started
    print(f"{len(urls)} pushes in {wall:.2f} s; {cpu / len(urls):.4f} s CPU per push")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
