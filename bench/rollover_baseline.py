"""The rollover benchmark's baseline: a plain asyncua script moving a device from one CA to its successor, with
nothing of certlm.

For each device it does what any ordering of a rollover must do, each change applied on its own (the device drops
every channel a moment after ApplyChanges, so each step is a session of its own):

1. trust: Open (Read), Read, Close; Open (Write, EraseExisting), Write, CloseAndUpdate the list with the new CA and
   its CRL added; ApplyChanges when CloseAndUpdate asks for it;
2. renew: CreateSigningRequest (a new key on the device), the CSR signed with the new CA's key by ``cryptography``,
   UpdateCertificate with the new CA as issuer, ApplyChanges;
3. retire: the list of step 1 without the old CA and its CRL, written as in step 1.

Each session is preceded by GetEndpoints, repeated until the device listens again and presents the certificate the
step expects; a step whose session the device drops (opened just before it reopened its endpoints) is done again.
Sessions are SignAndEncrypt with Aes256Sha256RsaPss, the policy certlm picks on the simulated devices, as the admin
user. The client's key is parsed once, not for each session as ``Client.set_security`` does (tens of ms of CPU each
time): the script is as lean as a careful author would write it. Key sizes are certlm's: CAs RSA 3072, the client RSA
2048, device keys the device's own. ``Plant.onboard`` puts a fresh simulated device in the state certlm leaves it in
after an onboarding with ``issuer: true``; it is set-up, not measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from asyncua import Client, ua
from asyncua.common.utils import Buffer
from asyncua.crypto.security_policies import SecurityPolicyAes256Sha256RsaPss
from asyncua.ua.ua_binary import struct_from_binary, struct_to_binary
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

APPLICATION_URI = f"urn:{socket.gethostname()}:rollover-baseline"
ADMIN_USER, ADMIN_PASSWORD = "admin", "admin-pw"
POLICY = SecurityPolicyAes256Sha256RsaPss
# asyncua's watchdog (a server-state read every second of a session) off, as certlm's driver has it: see
# asyncua_baseline.WATCHDOG_OFF_S.
WATCHDOG_OFF_S = 600
CA_KEY_BITS = 3072  # as certlm's internal CA
CLIENT_KEY_BITS = 2048  # as certlm's OPC UA client
# The simulated device reopens its endpoints this long after ApplyChanges (certlm-simulate's default --apply-delay,
# and what certlm's driver for it waits): a session before that meets the channel that is about to drop.
APPLY_SETTLE_S = 0.5
ENDPOINT_POLL_S = 0.05
READ_CHUNK = 32 * 1024
SERVER_CONFIGURATION = ua.NodeId(ua.ObjectIds.ServerConfiguration)
GROUP = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup)
CERTIFICATE_TYPE = ua.NodeId(ua.ObjectIds.RsaSha256ApplicationCertificateType)
TRUST_LIST = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList)
ALL_LISTS = ua.TrustListMasks.All
_T = TypeVar("_T")


def _method(name: str) -> ua.NodeId:
    return ua.NodeId(getattr(ua.ObjectIds, f"ServerConfiguration_{name}"))


def _trust_list_method(name: str) -> ua.NodeId:
    return _method(f"CertificateGroups_DefaultApplicationGroup_TrustList_{name}")


def der(item: x509.Certificate | x509.CertificateRevocationList) -> bytes:
    return item.public_bytes(serialization.Encoding.DER)


def _key_usage(*, ca: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True, content_commitment=not ca, key_encipherment=not ca, data_encipherment=not ca,
        key_agreement=False, key_cert_sign=ca, crl_sign=ca, encipher_only=False, decipher_only=False,
    )  # fmt: skip


@dataclass(frozen=True)
class Ca:
    """A root CA with its (empty) CRL."""

    key: rsa.RSAPrivateKey
    certificate: x509.Certificate
    crl: x509.CertificateRevocationList

    @classmethod
    def create(cls, name: str) -> Ca:
        now = datetime.now(UTC)
        key = rsa.generate_private_key(public_exponent=65537, key_size=CA_KEY_BITS)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        certificate = (
            x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(_key_usage(ca=True), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        crl = (
            x509.CertificateRevocationListBuilder().issuer_name(subject).last_update(now - timedelta(minutes=5))
            .next_update(now + timedelta(days=7)).add_extension(x509.CRLNumber(1), critical=False)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        return cls(key, certificate, crl)

    def sign(self, csr: x509.CertificateSigningRequest) -> x509.Certificate:
        """The certificate for a device's CSR: its subject and subject alternative names."""
        if not csr.is_signature_valid:
            raise ValueError("the CSR's signature does not verify")
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return application_certificate(csr.subject, csr.public_key(), san, self.certificate.subject, self.key)


def application_certificate(
    subject: x509.Name,
    public_key: rsa.RSAPublicKey,
    san: x509.SubjectAlternativeName,
    issuer: x509.Name,
    issuer_key: rsa.RSAPrivateKey,
) -> x509.Certificate:
    """An application instance certificate (Part 6) for ``public_key``, signed by ``issuer_key``."""
    now = datetime.now(UTC)
    return (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
        .public_key(public_key).serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(san, critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
        .sign(issuer_key, hashes.SHA256())
    )  # fmt: skip


SESSIONS_PER_ROLLOVER = 3  # trust, renew, retire: each change is applied on its own, and ApplyChanges drops the channel


@dataclass(frozen=True)
class CryptoFloor:
    """CPU seconds of the cryptography a device's rollover cannot do without, measured in this process: per secure
    session the client's RSA 2048 private-key operations (the OpenSecureChannel request's signature, the decryption of
    the device's answer, the ActivateSession signature) and the public-key ones beside them (the device's signatures
    checked, what is sent encrypted to it), and per renewal the CSR's signature checked and the CA's RSA 3072
    signature. The device's own work (its new key, its signatures) is the device's."""

    per_session_s: float
    per_renewal_s: float

    @property
    def per_device_s(self) -> float:
        return SESSIONS_PER_ROLLOVER * self.per_session_s + self.per_renewal_s

    @classmethod
    def measure(cls, rounds: int = 30) -> CryptoFloor:
        client_key = rsa.generate_private_key(public_exponent=65537, key_size=CLIENT_KEY_BITS)
        device_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        ca = Ca.create("floor CA")
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "floor device")])
        san = x509.SubjectAlternativeName([x509.UniformResourceIdentifier("urn:floor:device")])
        csr = (
            x509.CertificateSigningRequestBuilder().subject_name(name).add_extension(san, critical=False)
            .sign(device_key, hashes.SHA256())
        )  # fmt: skip
        nonce = os.urandom(32)
        pss = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=32)
        oaep = padding.OAEP(mgf=padding.MGF1(hashes.SHA256()), algorithm=hashes.SHA256(), label=None)
        device_signature = device_key.sign(nonce, pss, hashes.SHA256())
        answer = client_key.public_key().encrypt(nonce, oaep)  # the device's OpenSecureChannel answer, for the client
        started = time.process_time()
        for _ in range(rounds):
            for _ in range(2):  # the OpenSecureChannel request's and the ActivateSession signature
                client_key.sign(nonce, pss, hashes.SHA256())
            client_key.decrypt(answer, oaep)
            for _ in range(2):  # the device's OpenSecureChannel and CreateSession signatures
                device_key.public_key().verify(device_signature, nonce, pss, hashes.SHA256())
            for _ in range(2):  # the OpenSecureChannel request and the password, encrypted for the device
                device_key.public_key().encrypt(nonce, oaep)
        per_session = (time.process_time() - started) / rounds
        started = time.process_time()
        for _ in range(rounds):
            ca.sign(csr)
        return cls(per_session, (time.process_time() - started) / rounds)


@dataclass(frozen=True)
class Plant:
    """The script's client (a self-signed certificate, as certlm's on a fresh ``certlm serve``: it is made at start-up,
    before any CA), the old CA the devices have their certificates from, and its successor."""

    old: Ca
    new: Ca
    client_certificate: x509.Certificate
    client_key: rsa.RSAPrivateKey

    @classmethod
    def create(cls) -> Plant:
        client_key = rsa.generate_private_key(public_exponent=65537, key_size=CLIENT_KEY_BITS)
        san = x509.SubjectAlternativeName(
            [x509.UniformResourceIdentifier(APPLICATION_URI), x509.DNSName(socket.gethostname())]
        )
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rollover baseline client")])
        client_certificate = application_certificate(name, client_key.public_key(), san, name, client_key)
        return cls(Ca.create("Plant CA"), Ca.create("Plant CA 2027"), client_certificate, client_key)

    @asynccontextmanager
    async def session(self, url: str, presenting: bytes | None) -> AsyncIterator[Client]:
        """A SignAndEncrypt session as the admin user, once the device listens and presents ``presenting`` (DER; None:
        whatever it presents)."""
        endpoint = await _endpoint_presenting(url, presenting)
        client = Client(url, watchdog_intervall=WATCHDOG_OFF_S)
        client.application_uri = APPLICATION_URI
        client.security_policy = POLICY(
            x509.load_der_x509_certificate(endpoint.ServerCertificate), self.client_certificate, self.client_key,
            ua.MessageSecurityMode.SignAndEncrypt,
        )  # fmt: skip
        client.uaclient.set_security(client.security_policy)
        client.set_user(ADMIN_USER)
        client.set_password(ADMIN_PASSWORD)
        await client.connect()
        try:
            yield client
        finally:
            with contextlib.suppress(OSError, TimeoutError):  # a device about to reopen may drop the channel first
                await client.disconnect()

    async def onboard(self, url: str) -> bytes:
        """Set-up, not measured: the device's first certificate from the old CA and a trust list of the old CA with its
        CRL and the client's certificate, as certlm leaves a device onboarded with ``issuer: true`` (its client
        certificate is self-signed, so the device trusts the certificate itself). The device's certificate (DER)."""
        async with self.session(url, None) as client:
            issued = await _renew(client, self.old)
            trust_list = ua.TrustListDataType(
                SpecifiedLists=ALL_LISTS,
                TrustedCertificates=[der(self.old.certificate), der(self.client_certificate)],
                TrustedCrls=[der(self.old.crl)], IssuerCertificates=[], IssuerCrls=[],
            )  # fmt: skip
            await _write_trust_list(client, trust_list, apply=False)
            await _update_certificate(client, issued, self.old)
        await _endpoint_presenting(url, der(issued))
        return der(issued)

    async def roll_over(self, url: str, presented: bytes) -> None:
        """The three steps of the module's docstring on the device at ``url``, which presents ``presented`` (DER)."""
        trust_list = await _again_when_dropped(lambda: self.trust_new_issuer(url, presented))
        await asyncio.sleep(APPLY_SETTLE_S)
        issued = await _again_when_dropped(lambda: self.renew(url, presented))
        await asyncio.sleep(APPLY_SETTLE_S)
        await _again_when_dropped(lambda: self.retire_old_issuer(url, issued, trust_list))

    async def trust_new_issuer(self, url: str, presented: bytes) -> ua.TrustListDataType:
        """Step 1; the list as written."""
        async with self.session(url, presented) as client:
            trust_list = await _read_trust_list(client)
            for name, item in (("TrustedCertificates", der(self.new.certificate)), ("TrustedCrls", der(self.new.crl))):
                if item not in getattr(trust_list, name):
                    setattr(trust_list, name, [*getattr(trust_list, name), item])
            await _write_trust_list(client, trust_list, apply=True)
        return trust_list

    async def renew(self, url: str, presented: bytes) -> bytes:
        """Step 2; the new certificate (DER)."""
        async with self.session(url, presented) as client:
            issued = await _renew(client, self.new)
            await _update_certificate(client, issued, self.new)
        return der(issued)

    async def retire_old_issuer(self, url: str, presented: bytes, trust_list: ua.TrustListDataType) -> None:
        """Step 3: ``trust_list`` (as step 1 wrote it) without the old CA and its CRL."""
        old = {der(self.old.certificate), der(self.old.crl)}
        without_old = ua.TrustListDataType(
            SpecifiedLists=trust_list.SpecifiedLists,
            TrustedCertificates=[item for item in trust_list.TrustedCertificates if item not in old],
            TrustedCrls=[item for item in trust_list.TrustedCrls if item not in old],
            IssuerCertificates=trust_list.IssuerCertificates, IssuerCrls=trust_list.IssuerCrls,
        )  # fmt: skip
        async with self.session(url, presented) as client:
            await _write_trust_list(client, without_old, apply=True)


async def _again_when_dropped(step: Callable[[], Awaitable[_T]], timeout_s: float = 60.0) -> _T:
    """``step``, again while the device drops the connection: it closes every channel a moment after ApplyChanges, and
    a session opened just before that is lost."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await step()
        except (OSError, TimeoutError):
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(ENDPOINT_POLL_S)


async def _endpoint_presenting(url: str, presenting: bytes | None, timeout_s: float = 60.0) -> ua.EndpointDescription:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            endpoints = await Client(url).connect_and_get_server_endpoints()
        except (ConnectionError, OSError, TimeoutError):
            endpoints = []  # the device is reopening its endpoints
        if endpoints:
            endpoint = Client.find_endpoint(endpoints, ua.MessageSecurityMode.SignAndEncrypt, POLICY.URI)
            if presenting is None or endpoint.ServerCertificate == presenting:
                return endpoint
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} does not present the expected certificate")
        await asyncio.sleep(ENDPOINT_POLL_S)


async def _read_trust_list(client: Client) -> ua.TrustListDataType:
    trust_list = client.get_node(TRUST_LIST)
    handle = await trust_list.call_method(
        _trust_list_method("Open"), ua.Variant(ua.OpenFileMode.Read, ua.VariantType.Byte)
    )
    handle_argument = ua.Variant(handle, ua.VariantType.UInt32)
    content = b""
    while True:
        chunk = await trust_list.call_method(
            _trust_list_method("Read"), handle_argument, ua.Variant(READ_CHUNK, ua.VariantType.Int32)
        )
        content += chunk or b""
        if not chunk or len(chunk) < READ_CHUNK:
            break
    await trust_list.call_method(_trust_list_method("Close"), handle_argument)
    return struct_from_binary(ua.TrustListDataType, Buffer(content))


async def _write_trust_list(client: Client, data: ua.TrustListDataType, *, apply: bool) -> None:
    """Open (Write, EraseExisting), Write, CloseAndUpdate, and with ``apply`` ApplyChanges when the device asks."""
    trust_list = client.get_node(TRUST_LIST)
    handle = await trust_list.call_method(
        _trust_list_method("Open"),
        ua.Variant(ua.OpenFileMode.Write | ua.OpenFileMode.EraseExisting, ua.VariantType.Byte),
    )
    handle_argument = ua.Variant(handle, ua.VariantType.UInt32)
    await trust_list.call_method(_trust_list_method("Write"), handle_argument, struct_to_binary(data))
    apply_required = await trust_list.call_method(_trust_list_method("CloseAndUpdate"), handle_argument)
    if apply and apply_required:
        await client.get_node(SERVER_CONFIGURATION).call_method(_method("ApplyChanges"))


async def _renew(client: Client, ca: Ca) -> x509.Certificate:
    """CreateSigningRequest for a new key, signed by ``ca``."""
    csr_der = await client.get_node(SERVER_CONFIGURATION).call_method(
        _method("CreateSigningRequest"), GROUP, CERTIFICATE_TYPE, "", True, os.urandom(32)
    )
    return ca.sign(x509.load_der_x509_csr(csr_der))


async def _update_certificate(client: Client, issued: x509.Certificate, ca: Ca) -> None:
    configuration = client.get_node(SERVER_CONFIGURATION)
    await configuration.call_method(
        _method("UpdateCertificate"), GROUP, CERTIFICATE_TYPE, der(issued), [der(ca.certificate)], "", b""
    )
    await configuration.call_method(_method("ApplyChanges"))
