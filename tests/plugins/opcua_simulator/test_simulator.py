"""The OPC UA device simulator, checked with a raw asyncua client as a Part 12 push client would use it."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from asyncua import Client, ua
from asyncua.common.utils import Buffer
from asyncua.crypto import security_policies
from asyncua.ua import uaerrors
from certlm_opcua_simulator import SimulatedDevice, SimulatorConfig, TrustList, run_devices
from certlm_opcua_simulator.cli import parse_arguments
from certlm_opcua_simulator.config import DEFAULT_SECURITY_POLICIES
from certlm_opcua_simulator.store import StateFolder
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import pkcs12
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.crypto_factory import Credential, certificate, ec_key, rsa_key
from tests.support import free_port

DER = serialization.Encoding.DER
SIGN_AND_ENCRYPT = ua.MessageSecurityMode.SignAndEncrypt
CLIENT_URI = Client("opc.tcp://127.0.0.1:4840").application_uri
SERVER_CONFIGURATION = ua.NodeId(ua.ObjectIds.ServerConfiguration)
TRUST_LIST = ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList)
TRUST_LIST_IDS = "ServerConfiguration_CertificateGroups_DefaultApplicationGroup_TrustList"
NULL_NODE = ua.Variant(ua.NodeId(), ua.VariantType.NodeId)
READ, WRITE_ERASING = 1, 6


# Certificates made for the tests


@dataclass(frozen=True)
class Identity(Credential):
    @property
    def der(self) -> bytes:
        return self.certificate.public_bytes(DER)

    @property
    def key_der(self) -> bytes:
        return self.key.private_bytes(DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def issue(
    issuer: Identity | None,
    key,
    common_name: str,
    *,
    uri: str | None = None,
    ca: bool = False,
    not_before: datetime | None = None,
    days: int = 30,
) -> x509.Certificate:
    """A certificate for ``key``, signed by ``issuer`` (self-signed when None); ``uri`` makes it an application
    instance certificate (that URI and localhost, client and server use)."""
    options = {"ca": ca, "not_before": not_before, "days": days, "key_identifiers": ca}
    if uri:
        options |= {"san": [x509.UniformResourceIdentifier(uri), x509.DNSName("localhost")]}
        options |= {"extended_key_usage": (ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH)}
    if issuer is None:
        return certificate(common_name, key.public_key(), key, **options)
    return issuer.issue(common_name, key.public_key(), **options)


def make_ca(common_name: str, issuer: Identity | None = None) -> Identity:
    key = ec_key()  # EC keeps CA creation fast; OPC UA's RSA policies only need RSA for the end entities
    return Identity(issue(issuer, key, common_name, ca=True, days=365), key)


def make_client(common_name: str = "client", issuer: Identity | None = None) -> Identity:
    key = rsa_key()
    return Identity(issue(issuer, key, common_name, uri=CLIENT_URI), key)


def make_crl(ca: Identity, revoked: tuple[x509.Certificate, ...] = ()) -> bytes:
    return ca.crl(revoked, days=7).public_bytes(DER)


def sign_request(ca: Identity, request_der: bytes, days: int = 30) -> x509.Certificate:
    return ca.sign_request(x509.load_der_x509_csr(request_der), days=days)


def trust_list(
    masks: int = ua.TrustListMasks.All,
    trusted: tuple[bytes, ...] = (),
    trusted_crls: tuple[bytes, ...] = (),
    issuers: tuple[bytes, ...] = (),
    issuer_crls: tuple[bytes, ...] = (),
) -> ua.TrustListDataType:
    return ua.TrustListDataType(
        SpecifiedLists=masks,
        TrustedCertificates=list(trusted),
        TrustedCrls=list(trusted_crls),
        IssuerCertificates=list(issuers),
        IssuerCrls=list(issuer_crls),
    )


def trusting(admin: Identity, *cas: Identity) -> ua.TrustListDataType:
    """The trust list a push client writes before a certificate issued by ``cas``: itself, the CAs and their CRLs."""
    return trust_list(trusted=(admin.der, *(ca.der for ca in cas)), trusted_crls=tuple(make_crl(ca) for ca in cas))


def pkcs8_pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


# Talking to a device


@asynccontextmanager
async def connect(
    device: SimulatedDevice,
    identity: Identity | None = None,
    *,
    user: tuple[str, str] | Identity | None = ("admin", "admin-pw"),
    mode: ua.MessageSecurityMode = SIGN_AND_ENCRYPT,
    policy: type[security_policies.SecurityPolicy] = security_policies.SecurityPolicyBasic256Sha256,
    pin_server_certificate: bool = True,
) -> AsyncIterator[Client]:
    """A session of ``user`` (name and password, an X.509 user identity, or anonymous); with a client
    application ``identity`` over ``policy`` in ``mode``, else over None."""
    client = Client(device.url, timeout=5)
    if isinstance(user, Identity):
        client.user_certificate, client.user_private_key = user.certificate, user.key
    elif user:
        client.set_user(user[0])
        client.set_password(user[1])
    if identity:
        await client.set_security(
            policy,
            identity.der,
            identity.key_der,
            server_certificate=device.certificate.public_bytes(DER) if pin_server_certificate else None,
            mode=mode,
        )
    await client.connect()
    try:
        yield client
    finally:
        with suppress(Exception):
            await client.disconnect()


async def call_configuration(client: Client, method: int, *arguments: ua.Variant):
    return await client.get_node(SERVER_CONFIGURATION).call_method(ua.NodeId(method), *arguments)


async def call_trust_list(client: Client, name: str, *arguments: ua.Variant):
    method = getattr(ua.ObjectIds, f"{TRUST_LIST_IDS}_{name}")
    return await client.get_node(TRUST_LIST).call_method(ua.NodeId(method), *arguments)


def handle(value: int) -> ua.Variant:
    return ua.Variant(value, ua.VariantType.UInt32)


async def create_signing_request(
    client: Client, subject: str = "", regenerate: bool = True, nonce: bytes | None = None
) -> bytes:
    return await call_configuration(
        client,
        ua.ObjectIds.ServerConfiguration_CreateSigningRequest,
        NULL_NODE,
        ua.Variant(ua.NodeId(ua.ObjectIds.RsaSha256ApplicationCertificateType), ua.VariantType.NodeId),
        ua.Variant(subject, ua.VariantType.String),
        ua.Variant(regenerate, ua.VariantType.Boolean),
        ua.Variant(os.urandom(32) if nonce is None else nonce, ua.VariantType.ByteString),
    )


async def update_certificate(
    client: Client,
    certificate: bytes,
    issuers: tuple[bytes, ...] = (),
    key_format: str = "",
    key: bytes = b"",
    *,
    group: ua.NodeId | None = None,
    certificate_type: int = ua.ObjectIds.RsaSha256ApplicationCertificateType,
) -> bool:
    return await call_configuration(
        client,
        ua.ObjectIds.ServerConfiguration_UpdateCertificate,
        ua.Variant(group or ua.NodeId(), ua.VariantType.NodeId),
        ua.Variant(ua.NodeId(certificate_type), ua.VariantType.NodeId),
        ua.Variant(certificate, ua.VariantType.ByteString),
        ua.Variant(list(issuers), ua.VariantType.ByteString),
        ua.Variant(key_format, ua.VariantType.String),
        ua.Variant(key, ua.VariantType.ByteString),
    )


async def apply_changes(client: Client) -> None:
    await call_configuration(client, ua.ObjectIds.ServerConfiguration_ApplyChanges)


async def cancel_changes(client: Client) -> None:
    await call_configuration(client, ua.ObjectIds.ServerConfiguration_CancelChanges)


async def rejected_list(client: Client) -> list[bytes]:
    return await call_configuration(client, ua.ObjectIds.ServerConfiguration_GetRejectedList)


async def write_trust_list(client: Client, data: bytes | ua.TrustListDataType, chunk: int = 512) -> bool:
    """Open for Write + EraseExisting, write ``data`` in chunks, CloseAndUpdate."""
    if isinstance(data, ua.TrustListDataType):
        data = ua.ua_binary.struct_to_binary(data)
    file = await call_trust_list(client, "Open", ua.Variant(WRITE_ERASING, ua.VariantType.Byte))
    for start in range(0, len(data), chunk):
        await call_trust_list(
            client, "Write", handle(file), ua.Variant(data[start : start + chunk], ua.VariantType.ByteString)
        )
    return await call_trust_list(client, "CloseAndUpdate", handle(file))


async def read_trust_list(client: Client, masks: int = ua.TrustListMasks.All, chunk: int = 300) -> ua.TrustListDataType:
    file = await call_trust_list(client, "OpenWithMasks", handle(masks))
    data = b""
    while part := await call_trust_list(client, "Read", handle(file), ua.Variant(chunk, ua.VariantType.Int32)):
        data += part
    await call_trust_list(client, "Close", handle(file))
    return ua.ua_binary.struct_from_binary(ua.TrustListDataType, Buffer(data))


async def presented_certificate(device: SimulatedDevice) -> bytes:
    endpoints = await Client(device.url, timeout=5).connect_and_get_server_endpoints()
    assert len({endpoint.ServerCertificate for endpoint in endpoints}) == 1
    return endpoints[0].ServerCertificate


async def eventually_presented(device: SimulatedDevice, certificate: x509.Certificate, within_s: float = 10) -> None:
    """Until the endpoints present ``certificate``, asking every 20 ms for at most ``within_s`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    wanted, presented = certificate.public_bytes(DER), None
    while loop.time() < deadline:
        with suppress(OSError, uaerrors.UaError):  # refused or cut while the endpoints reopen
            presented = await presented_certificate(device)
            if presented == wanted:
                return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{device.url} still presents {presented!r} after {within_s} s, not the new certificate")


async def trust_at_first(device: SimulatedDevice, admin: Identity, *cas: Identity) -> None:
    """Write and apply a trust list holding ``cas`` with their CRLs, and wait for the endpoints to reopen."""
    async with connect(device, admin) as client:
        assert await write_trust_list(client, trusting(admin, *cas)) is True
        await apply_changes(client)
    await device.settle()


# Fixtures


@pytest.fixture(scope="module")
def admin() -> Identity:
    """The client application certificate every device of these tests trusts from its first start."""
    return make_client("certlm")


@pytest.fixture(scope="module")
def ca() -> Identity:
    return make_ca("Test Plant CA")


@pytest.fixture
def config(tmp_path: Path, admin: Identity) -> SimulatorConfig:
    return SimulatorConfig(
        state_dir=tmp_path / "state",
        port=free_port(),
        trusted_client_certificates=(admin.der,),
        apply_delay_s=0.05,
    )


@pytest.fixture
async def device(config: SimulatorConfig) -> AsyncIterator[SimulatedDevice]:
    async with SimulatedDevice(config) as device:
        yield device


@pytest.fixture(scope="module")
async def shared_device(tmp_path_factory: pytest.TempPathFactory, admin: Identity) -> AsyncIterator[SimulatedDevice]:
    """A device the tests below only read from or are refused by."""
    config = SimulatorConfig(
        state_dir=tmp_path_factory.mktemp("shared"), port=free_port(), trusted_client_certificates=(admin.der,)
    )
    async with SimulatedDevice(config) as device:
        yield device


# Identity and address space


async def test_device_identifies_itself_like_a_plc(shared_device: SimulatedDevice) -> None:
    async with connect(shared_device, user=None) as client:
        build_info = await client.get_node(ua.NodeId(ua.ObjectIds.Server_ServerStatus_BuildInfo)).read_value()
        assert (build_info.ManufacturerName, build_info.ProductName, build_info.SoftwareVersion) == (
            "certlm",
            "Simulated PLC",
            "1.0.0",
        )
        namespaces = await client.get_namespace_array()
        assert (
            namespaces[1]
            == shared_device.application_uri
            == f"urn:certlm:simulator:simulated-plc:{shared_device.config.port}"
        )
        di, simulator = namespaces.index("http://opcfoundation.org/UA/DI/"), namespaces.index("urn:certlm:simulator")
        device_set = await client.nodes.objects.get_child(f"{di}:DeviceSet")
        [plc_device] = await device_set.get_children()
        assert (await plc_device.read_browse_name()).Name == "SimulatedPLC"
        properties = {
            (await node.read_browse_name()).to_string(): await node.read_value()
            for node in await plc_device.get_properties()
        }
        assert properties == {
            f"{di}:Manufacturer": "certlm",
            f"{di}:Model": "Simulated PLC",
            f"{di}:SerialNumber": f"SIM-{shared_device.config.port:05d}",
            f"{di}:SoftwareRevision": "1.0.0",
            f"{di}:HardwareRevision": "1.0",
            f"{di}:DeviceRevision": "1.0",
            f"{di}:ProductCode": "SIMULATED-PLC",
        }
        plc = await client.nodes.objects.get_child(f"{simulator}:PLC")
        assert await (await plc.get_child(f"{simulator}:OperatingMode")).read_value() == "run"
        assert await (await plc.get_child(f"{simulator}:ProgramName")).read_value() == "Main"
        assert await (await plc.get_child(f"{simulator}:CycleTimeMs")).read_value() == 10.0


async def test_server_configuration_describes_push_support(shared_device: SimulatedDevice) -> None:
    async with connect(shared_device, user=None) as client:

        async def value(name: str):
            return await client.get_node(ua.NodeId(getattr(ua.ObjectIds, name))).read_value()

        assert await value("ServerConfiguration_SupportedPrivateKeyFormats") == ["PEM", "PFX"]
        assert await value("ServerConfiguration_MaxTrustListSize") == 0
        assert await value("ServerConfiguration_MulticastDnsEnabled") is False
        assert await value("ServerConfiguration_ServerCapabilities") == ["DA"]
        assert await value("ServerConfiguration_CertificateGroups_DefaultApplicationGroup_CertificateTypes") == [
            ua.NodeId(ua.ObjectIds.RsaSha256ApplicationCertificateType)
        ]
        assert await value(f"{TRUST_LIST_IDS}_OpenCount") == 0
        assert await value(f"{TRUST_LIST_IDS}_Size") == len(shared_device.trust_list.encode())
        groups = await client.get_node(ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups)).get_children()
        assert [(await group.read_browse_name()).Name for group in groups] == ["DefaultApplicationGroup"]
        method_names = {
            (await node.read_browse_name()).Name for node in await client.get_node(SERVER_CONFIGURATION).get_methods()
        }
        assert {"CreateSigningRequest", "UpdateCertificate", "ApplyChanges", "CancelChanges", "GetRejectedList"} <= (
            method_names
        )
        assert "GetCertificates" in method_names


async def test_endpoints_offer_none_and_three_policies_signed_and_encrypted(shared_device: SimulatedDevice) -> None:
    endpoints = await Client(shared_device.url).connect_and_get_server_endpoints()
    offered = {(endpoint.SecurityPolicyUri.rsplit("#", 1)[1], endpoint.SecurityMode.name) for endpoint in endpoints}
    assert offered == {("None", "None_")} | {
        (policy, mode)
        for policy in ("Basic256Sha256", "Aes128_Sha256_RsaOaep", "Aes256_Sha256_RsaPss")
        for mode in ("Sign", "SignAndEncrypt")
    }
    certificate = x509.load_der_x509_certificate(endpoints[0].ServerCertificate)
    assert certificate == shared_device.certificate
    assert certificate.public_key().key_size == 2048
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == [shared_device.application_uri]
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    usage = certificate.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and usage.content_commitment and usage.key_encipherment and usage.data_encipherment


# Who may do what


async def test_push_works_over_every_sign_and_encrypt_policy(config: SimulatorConfig, admin: Identity) -> None:
    deprecated = ("Basic128Rsa15_SignAndEncrypt", "Basic256_SignAndEncrypt")
    async with SimulatedDevice(replace(config, security_policies=DEFAULT_SECURITY_POLICIES + deprecated)) as device:
        for policy in (
            security_policies.SecurityPolicyBasic256Sha256,
            security_policies.SecurityPolicyAes128Sha256RsaOaep,
            security_policies.SecurityPolicyAes256Sha256RsaPss,
            security_policies.SecurityPolicyBasic128Rsa15,
            security_policies.SecurityPolicyBasic256,
        ):
            async with connect(device, admin, policy=policy) as client:
                assert await rejected_list(client) == [], policy


async def test_wrong_password_is_refused(shared_device: SimulatedDevice, admin: Identity) -> None:
    with pytest.raises(uaerrors.BadUserAccessDenied):
        async with connect(shared_device, admin, user=("admin", "not-the-password")):
            pass


@pytest.mark.parametrize("user", [("operator", "operator-pw"), None], ids=["operator", "anonymous"])
async def test_push_methods_need_a_security_admin(
    shared_device: SimulatedDevice, admin: Identity, user: tuple[str, str] | None
) -> None:
    async with connect(shared_device, admin, user=user) as client:
        assert await client.nodes.server.read_browse_name() == ua.QualifiedName("Server", 0)
        with pytest.raises(uaerrors.BadUserAccessDenied):
            await rejected_list(client)
        with pytest.raises(uaerrors.BadUserAccessDenied):
            await call_trust_list(client, "OpenWithMasks", handle(ua.TrustListMasks.All))
        with pytest.raises(uaerrors.BadUserAccessDenied):
            await create_signing_request(client)


@pytest.mark.parametrize("mode", [ua.MessageSecurityMode.Sign, ua.MessageSecurityMode.None_])
async def test_push_methods_need_sign_and_encrypt(
    shared_device: SimulatedDevice, admin: Identity, mode: ua.MessageSecurityMode
) -> None:
    identity = admin if mode == ua.MessageSecurityMode.Sign else None
    async with connect(shared_device, identity, mode=mode) as client:
        with pytest.raises(uaerrors.BadSecurityModeInsufficient):
            await rejected_list(client)
        with pytest.raises(uaerrors.BadSecurityModeInsufficient):
            await call_trust_list(client, "Open", ua.Variant(READ, ua.VariantType.Byte))


async def test_untrusted_client_is_refused_and_listed_once(shared_device: SimulatedDevice, admin: Identity) -> None:
    stranger = make_client("stranger")
    for _ in range(2):
        with pytest.raises(uaerrors.BadCertificateUntrusted):
            async with connect(shared_device, stranger):
                pass
    async with connect(shared_device, admin) as client:
        rejected = await rejected_list(client)
    assert rejected.count(stranger.der) == 1
    assert stranger.der in shared_device.rejected


async def test_client_certificate_must_carry_the_application_uri(config: SimulatorConfig) -> None:
    key = rsa_key()
    misnamed = Identity(issue(None, key, "misnamed", uri="urn:somebody:else"), key)
    # A device accepting every certificate still wants it to name the client application.
    async with SimulatedDevice(replace(config, auto_accept=True, trusted_client_certificates=())) as device:
        with pytest.raises(uaerrors.BadCertificateUriInvalid):
            async with connect(device, misnamed):
                pass


async def test_x509_user_token_logs_in_as_admin(config: SimulatorConfig, admin: Identity) -> None:
    engineer = make_client("maintenance engineer")
    async with SimulatedDevice(replace(config, admin_user_certificates=(engineer.der,))) as device:
        async with connect(device, admin, user=engineer) as client:
            assert await rejected_list(client) == []
        with pytest.raises(uaerrors.BadUserAccessDenied):
            async with connect(device, admin, user=admin):
                pass


# Trust in client certificates


async def test_auto_accept_lasts_until_a_trust_list_is_applied(tmp_path: Path, admin: Identity) -> None:
    commissioning = SimulatorConfig(state_dir=tmp_path, port=free_port(), auto_accept=True, apply_delay_s=0.05)
    stranger = make_client("stranger")
    async with SimulatedDevice(commissioning) as device:
        assert device.trust_list.is_empty()
        async with connect(device, stranger) as client:
            assert await rejected_list(client) == []
        async with connect(device, admin) as client:
            assert await write_trust_list(client, trust_list(trusted=(admin.der,))) is True
            await apply_changes(client)
        await device.settle()
        with pytest.raises(uaerrors.BadCertificateUntrusted):
            async with connect(device, stranger):
                pass
        async with connect(device, admin) as client:
            assert await rejected_list(client) == [stranger.der]


async def test_client_is_trusted_through_its_ca_until_revoked(device: SimulatedDevice, admin: Identity) -> None:
    root = make_ca("Root CA")
    intermediate = make_ca("Line 4 CA", issuer=root)
    engineer = make_client("engineering station", issuer=intermediate)
    async with connect(device, admin) as client:
        assert await write_trust_list(
            client,
            trust_list(
                trusted=(admin.der, root.der),
                trusted_crls=(make_crl(root),),
                issuers=(intermediate.der,),
                issuer_crls=(make_crl(intermediate),),
            ),
        )
        await apply_changes(client)
    await device.settle()
    async with connect(device, engineer, user=("operator", "operator-pw")) as client:
        assert await client.nodes.server.read_browse_name() == ua.QualifiedName("Server", 0)
    async with connect(device, admin) as client:
        revocation = trust_list(
            ua.TrustListMasks.IssuerCrls, issuer_crls=(make_crl(intermediate, (engineer.certificate,)),)
        )
        assert await write_trust_list(client, revocation)
        await apply_changes(client)
    await device.settle()
    assert device.trust_list.issuer_certificates == (intermediate.der,)
    with pytest.raises(uaerrors.BadCertificateRevoked):
        async with connect(device, engineer, user=("operator", "operator-pw")):
            pass
    assert engineer.der in device.rejected


# The push cycle


async def test_full_push_cycle_survives_a_restart(config: SimulatorConfig, admin: Identity, ca: Identity) -> None:
    async with SimulatedDevice(config) as device:
        old = device.certificate
        async with connect(device, admin) as client:
            request = x509.load_der_x509_csr(await create_signing_request(client, "CN=plc-4711/O=Test Plant"))
            assert request.subject.rfc4514_string() == "CN=plc-4711,O=Test Plant"
            names = request.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            assert names.get_values_for_type(x509.UniformResourceIdentifier) == [device.application_uri]
            assert names.get_values_for_type(x509.DNSName) == ["localhost"]
            assert request.public_key() != old.public_key()
            new = sign_request(ca, request.public_bytes(DER))
            # Part 12 7.7: the trust list goes first, so that the device holds the CA and its CRL.
            new_trust_list = trust_list(trusted=(admin.der, ca.der), trusted_crls=(make_crl(ca),))
            assert await write_trust_list(client, new_trust_list, chunk=100) is True
            # Readers still see the applied list.
            assert (await read_trust_list(client)).TrustedCertificates == [admin.der]
            assert await update_certificate(client, new.public_bytes(DER), (ca.der,)) is True
            # Nothing changes before ApplyChanges.
            assert await presented_certificate(device) == old.public_bytes(DER)
            assert device.trust_list.trusted_certificates == (admin.der,)
            await apply_changes(client)
        await device.settle()
        assert device.certificate == new
        assert await presented_certificate(device) == new.public_bytes(DER)
        async with connect(device, admin, pin_server_certificate=False) as client:
            assert await read_trust_list(client) == new_trust_list
            [types, certificates] = await call_configuration(
                client, ua.ObjectIds.ServerConfiguration_GetCertificates, NULL_NODE
            )
            assert types == [ua.NodeId(ua.ObjectIds.RsaSha256ApplicationCertificateType)]
            assert certificates == [new.public_bytes(DER)]
    key_file = config.device_state_dir / "private-key.pem"
    assert key_file.stat().st_mode & 0o777 == 0o600
    async with SimulatedDevice(config) as restarted:
        assert await presented_certificate(restarted) == new.public_bytes(DER)
        assert restarted.trust_list.trusted_certificates == (admin.der, ca.der)
        async with connect(restarted, admin) as client:
            assert await read_trust_list(client) == new_trust_list


@pytest.mark.parametrize("key_format", ["PEM", "PFX"])
async def test_device_without_csr_takes_a_key_made_by_certlm(
    config: SimulatorConfig, admin: Identity, ca: Identity, key_format: str
) -> None:
    async with SimulatedDevice(replace(config, can_create_csr=False)) as device, connect(device, admin) as client:
        with pytest.raises(uaerrors.BadNotSupported):
            await create_signing_request(client)
        key = rsa_key()
        certificate = issue(ca, key, "plc-without-csr", uri=device.application_uri)
        if key_format == "PEM":
            blob = pkcs8_pem(key)
        else:
            blob = pkcs12.serialize_key_and_certificates(b"plc", key, certificate, None, serialization.NoEncryption())
        assert await write_trust_list(client, trusting(admin, ca)) is True
        assert await update_certificate(client, certificate.public_bytes(DER), (ca.der,), key_format, blob) is True
        await apply_changes(client)
        await device.settle()
        assert device.certificate == certificate
        assert await presented_certificate(device) == certificate.public_bytes(DER)


async def test_update_certificate_checks_like_a_real_device(
    config: SimulatorConfig, admin: Identity, ca: Identity
) -> None:
    other_ca = make_ca("Other CA")
    async with SimulatedDevice(replace(config, private_key_formats=("PEM",))) as device:
        # The device holds the CA and its CRL already, so that only the checks below refuse.
        await trust_at_first(device, admin, ca)
        uri = device.application_uri
        key = rsa_key()
        pem = pkcs8_pem(key)
        good = issue(ca, key, "plc", uri=uri).public_bytes(DER)
        tomorrow = datetime.now(UTC) + timedelta(days=1)
        expired = issue(ca, key, "plc", uri=uri, not_before=datetime.now(UTC) - timedelta(days=3), days=1)
        pkcs1 = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
        cases = {
            "not DER": (b"certificate", (ca.der,), "PEM", pem),
            "not yet valid": (
                issue(ca, key, "plc", uri=uri, not_before=tomorrow).public_bytes(DER),
                (ca.der,),
                "PEM",
                pem,
            ),
            "expired": (expired.public_bytes(DER), (ca.der,), "PEM", pem),
            "other URI": (issue(ca, key, "plc", uri="urn:other:device").public_bytes(DER), (ca.der,), "PEM", pem),
            "key of neither CSR nor device": (good, (ca.der,), "", b""),
            "key not matching": (good, (ca.der,), "PEM", pkcs8_pem(rsa_key())),
            "PKCS #1 instead of PKCS #8": (good, (ca.der,), "PEM", pkcs1),
            "format not supported": (good, (ca.der,), "PFX", b"pfx"),
            "wrong issuer": (good, (other_ca.der,), "PEM", pem),
            "issuer unknown": (issue(other_ca, key, "plc", uri=uri).public_bytes(DER), (), "PEM", pem),
            "EC key": (issue(ca, ec_key(), "plc", uri=uri).public_bytes(DER), (ca.der,), "", b""),
        }
        outcomes = {}
        async with connect(device, admin) as client:
            for case, (certificate, issuers, key_format, blob) in cases.items():
                with pytest.raises(uaerrors.UaStatusCodeError) as refused:
                    await update_certificate(client, certificate, issuers, key_format, blob)
                outcomes[case] = type(refused.value).__name__
            for case, arguments in {
                "certificate type": {"certificate_type": ua.ObjectIds.EccNistP256ApplicationCertificateType},
                "certificate group": {
                    "group": ua.NodeId(ua.ObjectIds.ServerConfiguration_CertificateGroups_DefaultHttpsGroup)
                },
            }.items():
                with pytest.raises(uaerrors.UaStatusCodeError) as refused:
                    await update_certificate(client, good, (ca.der,), "PEM", pem, **arguments)
                outcomes[case] = type(refused.value).__name__
            with pytest.raises(uaerrors.BadNothingToDo):
                await apply_changes(client)
    assert outcomes == {
        "not DER": "BadCertificateInvalid",
        "not yet valid": "BadCertificateTimeInvalid",
        "expired": "BadCertificateTimeInvalid",
        "other URI": "BadCertificateUriInvalid",
        "key of neither CSR nor device": "BadSecurityChecksFailed",
        "key not matching": "BadSecurityChecksFailed",
        "PKCS #1 instead of PKCS #8": "BadNotSupported",
        "format not supported": "BadNotSupported",
        "wrong issuer": "BadCertificateInvalid",
        "issuer unknown": "BadCertificateChainIncomplete",
        "EC key": "BadCertificateInvalid",
        "certificate type": "BadInvalidArgument",
        "certificate group": "BadInvalidArgument",
    }


async def test_signing_request_subjects_and_nonce(shared_device: SimulatedDevice, admin: Identity) -> None:
    async with connect(shared_device, admin) as client:

        async def subject(text: str) -> str:
            request = x509.load_der_x509_csr(await create_signing_request(client, text, regenerate=False))
            assert request.public_key() == shared_device.certificate.public_key()
            return request.subject.rfc4514_string()

        assert await subject("CN=plc/O=Plant/C=DE") == "CN=plc,O=Plant,C=DE"
        assert await subject('CN="line 4/cell 2"/S=Bavaria') == "CN=line 4/cell 2,ST=Bavaria"
        assert await subject("CN=plc,O=Plant") == "CN=plc,O=Plant"
        assert await subject("") == shared_device.certificate.subject.rfc4514_string()
        with pytest.raises(uaerrors.BadInvalidArgument):
            await subject("XX=plc")
        with pytest.raises(uaerrors.BadInvalidArgument):
            await create_signing_request(client, regenerate=True, nonce=b"short")


# The trust list file


async def test_trust_list_file_follows_part_12(device: SimulatedDevice, admin: Identity, ca: Identity) -> None:
    async with connect(device, admin) as client:
        only_trusted = await read_trust_list(client, ua.TrustListMasks.TrustedCertificates, chunk=64)
        assert only_trusted == trust_list(ua.TrustListMasks.TrustedCertificates, trusted=(admin.der,))
        file = await call_trust_list(client, "Open", ua.Variant(READ, ua.VariantType.Byte))
        first = await call_trust_list(client, "Read", handle(file), ua.Variant(10, ua.VariantType.Int32))
        assert await call_trust_list(client, "GetPosition", handle(file)) == 10
        await call_trust_list(client, "SetPosition", handle(file), ua.Variant(0, ua.VariantType.UInt64))
        assert await call_trust_list(client, "Read", handle(file), ua.Variant(10, ua.VariantType.Int32)) == first
        with pytest.raises(uaerrors.BadInvalidState):
            await call_trust_list(client, "Write", handle(file), ua.Variant(b"x", ua.VariantType.ByteString))
        await call_trust_list(client, "Close", handle(file))
        with pytest.raises(uaerrors.BadInvalidArgument):
            await call_trust_list(client, "Read", handle(file), ua.Variant(10, ua.VariantType.Int32))

        with pytest.raises(uaerrors.BadNotSupported):
            await call_trust_list(client, "Open", ua.Variant(2, ua.VariantType.Byte))
        with pytest.raises(uaerrors.BadInvalidArgument):
            await call_trust_list(client, "Open", ua.Variant(0, ua.VariantType.Byte))
        with pytest.raises(uaerrors.BadInvalidArgument):  # Part 4: wrong argument type
            await call_trust_list(client, "Open", ua.Variant(READ, ua.VariantType.Int32))
        with pytest.raises(uaerrors.BadArgumentsMissing):
            await call_trust_list(client, "Open")
        with pytest.raises(uaerrors.BadMethodInvalid):  # a TrustList method called on another object
            await client.get_node(SERVER_CONFIGURATION).call_method(
                ua.NodeId(getattr(ua.ObjectIds, f"{TRUST_LIST_IDS}_Open")), ua.Variant(READ, ua.VariantType.Byte)
            )

        # A TrustListDataType wrapped in an ExtensionObject is not the bare body Part 12 asks for.
        wrapped = ua.ua_binary.extensionobject_to_binary(trust_list(trusted=(admin.der,)))
        with pytest.raises(uaerrors.BadDecodingError):
            await write_trust_list(client, wrapped)
        with pytest.raises(uaerrors.BadCertificateInvalid):
            await write_trust_list(
                client, trust_list(trusted=(admin.certificate.public_bytes(serialization.Encoding.PEM),))
            )
        with pytest.raises(uaerrors.BadCertificateInvalid):  # a CRL without its CA
            await write_trust_list(client, trust_list(trusted=(admin.der,), trusted_crls=(make_crl(ca),)))
        open_count = client.get_node(ua.NodeId(getattr(ua.ObjectIds, f"{TRUST_LIST_IDS}_OpenCount")))
        assert await open_count.read_value() == 0

        file = await call_trust_list(client, "Open", ua.Variant(WRITE_ERASING, ua.VariantType.Byte))
        assert await open_count.read_value() == 1
        with pytest.raises(uaerrors.BadInvalidState):
            await call_trust_list(client, "Read", handle(file), ua.Variant(10, ua.VariantType.Int32))
        with pytest.raises(uaerrors.BadInvalidState):
            await apply_changes(client)
        await call_trust_list(client, "Close", handle(file))
        # Opening for writing started a transaction: immediate changes wait for it.
        with pytest.raises(uaerrors.BadTransactionPending):
            await call_trust_list(
                client,
                "AddCertificate",
                ua.Variant(ca.der, ua.VariantType.ByteString),
                ua.Variant(True, ua.VariantType.Boolean),
            )
        await apply_changes(client)
        assert device.trust_list.trusted_certificates == (admin.der,)


async def test_device_with_an_unreadable_trust_list_still_takes_one(
    config: SimulatorConfig, admin: Identity, ca: Identity
) -> None:
    async with SimulatedDevice(replace(config, trust_list_readable=False)) as device:
        async with connect(device, admin) as client:
            with pytest.raises(uaerrors.BadUserAccessDenied):
                await call_trust_list(client, "Open", ua.Variant(READ, ua.VariantType.Byte))
            with pytest.raises(uaerrors.BadUserAccessDenied):
                await read_trust_list(client)
            assert await write_trust_list(client, trusting(admin, ca)) is True
            await apply_changes(client)
        assert device.trust_list.trusted_certificates == (admin.der, ca.der)


async def test_add_and_remove_certificate_act_at_once(device: SimulatedDevice, admin: Identity, ca: Identity) -> None:
    partner = make_client("partner")
    issued_by_unknown_ca = make_client("orphan", issuer=make_ca("Unknown CA"))

    def certificate_argument(identity: Identity) -> ua.Variant:
        return ua.Variant(identity.der, ua.VariantType.ByteString)

    trusted = ua.Variant(True, ua.VariantType.Boolean)
    async with connect(device, admin) as client:
        await call_trust_list(client, "AddCertificate", certificate_argument(partner), trusted)
        assert device.trust_list.trusted_certificates == (admin.der, partner.der)
        with pytest.raises(uaerrors.BadCertificateInvalid):
            await call_trust_list(
                client, "AddCertificate", certificate_argument(ca), ua.Variant(False, ua.VariantType.Boolean)
            )
        with pytest.raises(uaerrors.BadCertificateChainIncomplete):
            await call_trust_list(client, "AddCertificate", certificate_argument(issued_by_unknown_ca), trusted)
        thumbprint = partner.certificate.fingerprint(hashes.SHA1()).hex()
        await call_trust_list(client, "RemoveCertificate", ua.Variant(thumbprint, ua.VariantType.String), trusted)
        assert device.trust_list.trusted_certificates == (admin.der,)
        with pytest.raises(uaerrors.BadInvalidArgument):
            await call_trust_list(client, "RemoveCertificate", ua.Variant(thumbprint, ua.VariantType.String), trusted)


async def test_trust_list_over_max_size_changes_nothing(config: SimulatorConfig, admin: Identity) -> None:
    first, second = make_client("partner 1").der, make_client("partner 2").der
    limit = len(ua.ua_binary.struct_to_binary(trust_list(trusted=(admin.der, first)))) + 10
    async with SimulatedDevice(replace(config, max_trust_list_size=limit)) as device, connect(device, admin) as client:
        assert await client.get_node(ua.NodeId(ua.ObjectIds.ServerConfiguration_MaxTrustListSize)).read_value() == limit
        data = ua.ua_binary.struct_to_binary(trust_list(trusted=(admin.der, first, second)))
        file = await call_trust_list(client, "Open", ua.Variant(WRITE_ERASING, ua.VariantType.Byte))
        await call_trust_list(client, "Write", handle(file), ua.Variant(data[:limit], ua.VariantType.ByteString))
        with pytest.raises(uaerrors.BadEncodingLimitsExceeded):
            await call_trust_list(client, "Write", handle(file), ua.Variant(data[limit:], ua.VariantType.ByteString))
        await call_trust_list(client, "Close", handle(file))
        await cancel_changes(client)
        assert device.trust_list.trusted_certificates == (admin.der,)
        trusted = ua.Variant(True, ua.VariantType.Boolean)
        await call_trust_list(client, "AddCertificate", ua.Variant(first, ua.VariantType.ByteString), trusted)
        with pytest.raises(uaerrors.BadRequestTooLarge):
            await call_trust_list(client, "AddCertificate", ua.Variant(second, ua.VariantType.ByteString), trusted)
        assert device.trust_list.trusted_certificates == (admin.der, first)


# Transactions


async def test_pending_changes_belong_to_their_session(device: SimulatedDevice, admin: Identity, ca: Identity) -> None:
    original = device.certificate
    async with connect(device, admin) as first:
        request = await create_signing_request(first)
        renewed = sign_request(ca, request).public_bytes(DER)
        assert await write_trust_list(first, trusting(admin, ca))
        assert await update_certificate(first, renewed, (ca.der,)) is True
        async with connect(device, admin) as second:
            with pytest.raises(uaerrors.BadTransactionPending):
                await update_certificate(second, renewed, (ca.der,))
            with pytest.raises(uaerrors.BadTransactionPending):
                await call_trust_list(second, "Open", ua.Variant(WRITE_ERASING, ua.VariantType.Byte))
            with pytest.raises(uaerrors.BadSessionIdInvalid):
                await apply_changes(second)
            with pytest.raises(uaerrors.BadSessionIdInvalid):
                await cancel_changes(second)
    # The first session closed without ApplyChanges: its changes are gone.
    async with connect(device, admin) as client:
        with pytest.raises(uaerrors.BadNothingToDo):
            await apply_changes(client)
        assert await write_trust_list(client, trusting(admin, ca))
        assert await update_certificate(client, renewed, (ca.der,)) is True
        await cancel_changes(client)
        with pytest.raises(uaerrors.BadNothingToDo):
            await cancel_changes(client)
    assert device.certificate == original
    assert device.trust_list.trusted_certificates == (admin.der,)


# The order of a push, and devices that apply at once


async def test_trust_list_does_not_open_while_a_certificate_update_is_pending(
    device: SimulatedDevice, admin: Identity, ca: Identity
) -> None:
    async with connect(device, admin) as client, connect(device, admin) as other:
        renewed = sign_request(ca, await create_signing_request(client)).public_bytes(DER)
        assert await write_trust_list(client, trusting(admin, ca)) is True
        # With only the trust list pending, readers still open it.
        assert (await read_trust_list(other)).TrustedCertificates == [admin.der]
        assert await update_certificate(client, renewed, (ca.der,)) is True
        for session in (client, other):
            with pytest.raises(uaerrors.BadTransactionPending):
                await call_trust_list(session, "Open", ua.Variant(READ, ua.VariantType.Byte))
            with pytest.raises(uaerrors.BadTransactionPending):
                await call_trust_list(session, "OpenWithMasks", handle(ua.TrustListMasks.All))
            with pytest.raises(uaerrors.BadTransactionPending):
                await call_trust_list(session, "Open", ua.Variant(WRITE_ERASING, ua.VariantType.Byte))
        await cancel_changes(client)
        assert (await read_trust_list(other)).TrustedCertificates == [admin.der]


async def test_update_certificate_wants_its_ca_and_crl_in_the_trust_list(
    device: SimulatedDevice, admin: Identity, ca: Identity
) -> None:
    root = make_ca("Plant Root CA")
    line_ca = make_ca("Line 4 CA", issuer=root)
    key = rsa_key()
    pem = pkcs8_pem(key)
    uri = device.application_uri
    by_ca = issue(ca, key, "plc", uri=uri)
    by_line_ca = issue(line_ca, key, "plc", uri=uri)
    self_signed = issue(None, key, "plc", uri=uri)
    both_cas = trust_list(
        trusted=(admin.der, root.der),
        trusted_crls=(make_crl(root),),
        issuers=(line_ca.der,),
        issuer_crls=(make_crl(line_ca),),
    )
    # Case: (trust list written first, new certificate, issuer certificates given with it).
    cases = {
        "CA given, not in the trust list": (trust_list(trusted=(admin.der,)), by_ca, (ca,)),
        "root given, not in the trust list": (trusting(admin, ca), by_line_ca, (line_ca, root)),
        "CA without its CRL": (trust_list(trusted=(admin.der, ca.der)), by_ca, (ca,)),
        "CRL revoking the certificate": (
            trust_list(trusted=(admin.der, ca.der), trusted_crls=(make_crl(ca, (by_ca,)),)),
            by_ca,
            (ca,),
        ),
        "issuing CA given, its CRL missing": (trusting(admin, root), by_line_ca, (line_ca,)),
        "root without its CRL": (
            trust_list(trusted=(admin.der, root.der), issuers=(line_ca.der,), issuer_crls=(make_crl(line_ca),)),
            by_line_ca,
            (),
        ),
        "issuing CA revoked by the root": (
            trust_list(
                trusted=(admin.der, root.der),
                trusted_crls=(make_crl(root, (line_ca.certificate,)),),
                issuers=(line_ca.der,),
                issuer_crls=(make_crl(line_ca),),
            ),
            by_line_ca,
            (),
        ),
    }
    outcomes = {}
    async with connect(device, admin) as client:
        for case, (first, certificate, issuers) in cases.items():
            assert await write_trust_list(client, first) is True
            with pytest.raises(uaerrors.UaStatusCodeError) as refused:
                await update_certificate(
                    client, certificate.public_bytes(DER), tuple(ca.der for ca in issuers), "PEM", pem
                )
            outcomes[case] = type(refused.value).__name__
            await cancel_changes(client)
        # A self-signed certificate needs no CA, and the same chains pass once the trust list holds them.
        assert await update_certificate(client, self_signed.public_bytes(DER), (), "PEM", pem) is True
        await cancel_changes(client)
        assert await write_trust_list(client, trusting(admin, ca)) is True
        assert await update_certificate(client, by_ca.public_bytes(DER), (ca.der,), "PEM", pem) is True
        await cancel_changes(client)
        assert await write_trust_list(client, both_cas) is True
        assert await update_certificate(client, by_line_ca.public_bytes(DER), (line_ca.der,), "PEM", pem) is True
        await apply_changes(client)
    assert outcomes == {
        "CA given, not in the trust list": "BadCertificateChainIncomplete",
        "root given, not in the trust list": "BadCertificateChainIncomplete",
        "CA without its CRL": "BadCertificateRevocationUnknown",
        "CRL revoking the certificate": "BadCertificateRevoked",
        "issuing CA given, its CRL missing": "BadCertificateRevocationUnknown",
        "root without its CRL": "BadCertificateIssuerRevocationUnknown",
        "issuing CA revoked by the root": "BadCertificateIssuerRevoked",
    }
    await eventually_presented(device, by_line_ca)
    assert device.trust_list == TrustList().updated(both_cas)


async def test_lenient_device_takes_the_certificate_before_the_trust_list(
    config: SimulatorConfig, admin: Identity, ca: Identity
) -> None:
    async with SimulatedDevice(replace(config, lenient=True)) as device:
        async with connect(device, admin) as client:
            new = sign_request(ca, await create_signing_request(client))
            # The CA is given but not in the trust list, and no CRL anywhere.
            assert await update_certificate(client, new.public_bytes(DER), (ca.der,)) is True
            assert (await read_trust_list(client)).TrustedCertificates == [admin.der]
            assert await write_trust_list(client, trust_list(trusted=(admin.der, ca.der))) is True
            await apply_changes(client)
        await eventually_presented(device, new)
        assert device.trust_list.trusted_certificates == (admin.der, ca.der)


async def test_trust_list_applied_at_once_needs_no_apply_changes(
    config: SimulatorConfig, admin: Identity, ca: Identity
) -> None:
    at_once = replace(config, trust_list_applies_at_once=True)
    new_trust_list = trusting(admin, ca)
    async with SimulatedDevice(at_once) as device, connect(device, admin) as client:
        assert await write_trust_list(client, new_trust_list) is False
        async with connect(device, admin) as other:
            assert await read_trust_list(other) == new_trust_list
        size = client.get_node(ua.NodeId(getattr(ua.ObjectIds, f"{TRUST_LIST_IDS}_Size")))
        assert await size.read_value() == len(ua.ua_binary.struct_to_binary(new_trust_list))
        with pytest.raises(uaerrors.BadNothingToDo):  # no transaction was left for it
            await apply_changes(client)
    async with SimulatedDevice(at_once) as restarted, connect(restarted, admin) as client:
        assert await read_trust_list(client) == new_trust_list


async def test_certificate_applied_at_once_is_presented_without_apply_changes(
    config: SimulatorConfig, admin: Identity, ca: Identity
) -> None:
    at_once = replace(config, certificate_applies_at_once=True)
    async with SimulatedDevice(at_once) as device:
        await trust_at_first(device, admin, ca)
        async with connect(device, admin) as client:
            new = sign_request(ca, await create_signing_request(client))
            assert await update_certificate(client, new.public_bytes(DER), (ca.der,)) is False
        await eventually_presented(device, new)
        async with connect(device, admin) as client:
            with pytest.raises(uaerrors.BadNothingToDo):
                await apply_changes(client)
    async with SimulatedDevice(at_once) as restarted:
        assert await presented_certificate(restarted) == new.public_bytes(DER)


@pytest.mark.parametrize(
    ("trust_list_at_once", "certificate_at_once"),
    [(True, False), (False, True), (True, True)],
    ids=["trust list at once", "certificate at once", "both at once"],
)
async def test_apply_changes_applies_what_did_not_apply_at_once(
    config: SimulatorConfig, admin: Identity, ca: Identity, trust_list_at_once: bool, certificate_at_once: bool
) -> None:
    mixed = replace(
        config, trust_list_applies_at_once=trust_list_at_once, certificate_applies_at_once=certificate_at_once
    )
    async with SimulatedDevice(mixed) as device:
        old = device.certificate.public_bytes(DER)
        async with connect(device, admin) as client:
            new = sign_request(ca, await create_signing_request(client))
            assert await write_trust_list(client, trusting(admin, ca)) is not trust_list_at_once
            assert await update_certificate(client, new.public_bytes(DER), (ca.der,)) is not certificate_at_once
            if not (trust_list_at_once and certificate_at_once):
                # Once the device is done with what it does by itself, it still presents the old certificate, and
                # the session lives on to apply what is pending.
                await asyncio.wait_for(device.settle(), 10)
                assert await presented_certificate(device) == old
                await apply_changes(client)
        await eventually_presented(device, new)
        assert device.trust_list.trusted_certificates == (admin.der, ca.der)
        async with connect(device, admin) as client:
            with pytest.raises(uaerrors.BadNothingToDo):
                await apply_changes(client)


# Injected failures


async def _reach_step(client: Client, step: str) -> None:
    if step == "create_signing_request":
        await create_signing_request(client)
    elif step == "update_certificate":
        await update_certificate(client, b"any")
    elif step == "trust_list_write":
        await call_trust_list(client, "Open", ua.Variant(WRITE_ERASING, ua.VariantType.Byte))
    elif step == "apply_changes":
        file = await call_trust_list(client, "Open", ua.Variant(WRITE_ERASING, ua.VariantType.Byte))
        await call_trust_list(client, "Close", handle(file))
        await apply_changes(client)
    else:
        await rejected_list(client)


@pytest.mark.parametrize(
    ("fail_at", "status"),
    [
        ("create_signing_request:BadResourceUnavailable", uaerrors.BadResourceUnavailable),
        ("update_certificate:BadOutOfMemory", uaerrors.BadOutOfMemory),
        ("trust_list_write:BadResourceUnavailable", uaerrors.BadResourceUnavailable),
        ("apply_changes:BadConfigurationError", uaerrors.BadConfigurationError),
        ("get_rejected_list", uaerrors.BadInternalError),
    ],
)
async def test_fail_at_answers_with_the_status(config: SimulatorConfig, admin: Identity, fail_at: str, status) -> None:
    async with SimulatedDevice(replace(config, fail_at=fail_at)) as device, connect(device, admin) as client:
        with pytest.raises(status):
            await _reach_step(client, fail_at.split(":")[0])


async def test_fail_at_drop_takes_the_device_down_mid_push(
    config: SimulatorConfig, admin: Identity, ca: Identity
) -> None:
    down = replace(config, fail_at="update_certificate:drop", fail_count=1, down_s=0.3)
    async with SimulatedDevice(down) as device:
        original = device.certificate
        async with connect(device, admin) as client:
            renewed = sign_request(ca, await create_signing_request(client)).public_bytes(DER)
            assert await write_trust_list(client, trusting(admin, ca))
            with pytest.raises(ConnectionError):  # no answer: the connection just closes
                await update_certificate(client, renewed, (ca.der,))
        assert not device.listening
        with pytest.raises(ConnectionRefusedError):
            await Client(device.url, timeout=2).connect_and_get_server_endpoints()
        await device.settle()
        assert device.listening
        assert await presented_certificate(device) == original.public_bytes(DER)
        async with connect(device, admin) as client:
            with pytest.raises(uaerrors.BadNothingToDo):  # the transaction died with the device
                await apply_changes(client)
            assert await write_trust_list(client, trusting(admin, ca))
            with pytest.raises(uaerrors.BadSecurityChecksFailed):  # and so did the CSR key
                await update_certificate(client, renewed, (ca.der,))
        assert device.trust_list.trusted_certificates == (admin.der,)


# Several devices and the command line


async def test_run_devices_on_consecutive_ports(config: SimulatorConfig) -> None:
    base = _free_ports(3)
    async with run_devices(replace(config, port=base), count=3) as devices:
        assert [device.url for device in devices] == [f"opc.tcp://127.0.0.1:{base + index}" for index in range(3)]
        uris = [x509.load_der_x509_certificate(await presented_certificate(device)) for device in devices]
        assert len({certificate.serial_number for certificate in uris}) == 3
        assert {device.application_uri for device in devices} == {
            f"urn:certlm:simulator:simulated-plc:{base + index}" for index in range(3)
        }
    assert sorted(path.name for path in config.state_dir.iterdir()) == [str(base + index) for index in range(3)]


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports."""
    while True:
        base = free_port()
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()


async def test_command_line_runs_devices_until_sigterm(tmp_path: Path) -> None:
    base = _free_ports(3)
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("certlm-simulate")),
        "--count", "3", "--port", str(base), "--state-dir", str(tmp_path), "--product", "Line PLC",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        ready = [(await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip() for _ in range(3)]
        assert ready == [f"READY opc.tcp://127.0.0.1:{base + index}" for index in range(3)]
        for index in range(3):
            endpoints = await Client(f"opc.tcp://127.0.0.1:{base + index}").connect_and_get_server_endpoints()
            assert endpoints[0].Server.ApplicationUri == f"urn:certlm:simulator:line-plc:{base + index}"
    finally:
        process.send_signal(signal.SIGTERM)
        _, errors = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, errors.decode()
    assert b"started 3 device(s) in" in errors


async def test_command_line_refuses_remote_hosts_unless_allowed(tmp_path: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).with_name("certlm-simulate")),
        "--host", "10.1.2.3", "--state-dir", str(tmp_path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, errors = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 2
    assert b"--allow-remote" in errors


def test_command_line_switches_reach_the_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def switches(*argv: str) -> tuple[bool, bool, bool, bool]:
        config, count = parse_arguments(["--state-dir", str(tmp_path), *argv])
        assert count == 1
        return (
            config.lenient,
            config.trust_list_applies_at_once,
            config.certificate_applies_at_once,
            config.trust_list_readable,
        )

    assert switches() == (False, False, False, True)
    assert switches("--lenient") == (True, False, False, True)
    assert switches("--trust-list-applies-at-once", "--certificate-applies-at-once") == (False, True, True, True)
    assert switches("--trust-list-unreadable") == (False, False, False, False)
    with pytest.raises(SystemExit):
        parse_arguments(["--help"])
    usage = " ".join(capsys.readouterr().out.split())
    for documented in (
        "--lenient",
        "--trust-list-applies-at-once",
        "--certificate-applies-at-once",
        "BadTransactionPending",
        "BadCertificateRevocationUnknown",
    ):
        assert documented in usage


async def test_command_line_says_when_trust_client_cert_is_ignored(tmp_path: Path, admin: Identity) -> None:
    certificate_file = tmp_path / "certlm.pem"
    certificate_file.write_bytes(admin.certificate.public_bytes(serialization.Encoding.PEM))
    port = free_port()
    state_dir = tmp_path / "sims"

    async def run_until_ready() -> str:
        process = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).with_name("certlm-simulate")),
            "--port", str(port), "--state-dir", str(state_dir), "--trust-client-cert", str(certificate_file),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert process.stdout is not None
            ready = await asyncio.wait_for(process.stdout.readline(), 30)
            assert ready.decode().strip() == f"READY opc.tcp://127.0.0.1:{port}"
        finally:
            process.send_signal(signal.SIGTERM)
            _, errors = await asyncio.wait_for(process.communicate(), 30)
        assert process.returncode == 0, errors.decode()
        return errors.decode()

    assert "ignored" not in await run_until_ready()
    state = StateFolder(state_dir / str(port)).load()
    assert state is not None and state.trust_list.trusted_certificates == (admin.der,)
    assert (
        f"--trust-client-cert ignored for 127.0.0.1:{port}: its state folder {state_dir / str(port)} already "
        "exists (delete it to start in factory state)"
    ) in await run_until_ready()


async def test_a_device_of_another_node_generation_has_its_trust_list_elsewhere(
    config: SimulatorConfig, admin: Identity
) -> None:
    with pytest.raises(ValueError, match="node_generation"):
        replace(config, node_generation=-1)
    async with SimulatedDevice(replace(config, node_generation=3)) as device, connect(device, admin) as client:
        paths = [
            ua.RelativePath.from_string(f"/0:ServerConfiguration/0:CertificateGroups/0:DefaultApplicationGroup{rest}")
            for rest in ("/0:TrustList", "/0:TrustList/0:Open", "/0:TrustList/0:Close", "/0:TrustList/0:Size")
        ]
        found = await client.translate_browsepaths(ua.NodeId(ua.ObjectIds.Server), paths)
        trust_list_id, open_id, close_id, size_id = (result.Targets[0].TargetId for result in found)
        assert trust_list_id == ua.NodeId(f"TrustList.3.{TRUST_LIST.Identifier}", 1)
        assert {node_id.NamespaceIndex for node_id in (open_id, close_id, size_id)} == {1}
        assert await client.get_node(size_id).read_value() == len(device.trust_list.encode())

        with pytest.raises(uaerrors.BadNodeIdInvalid):  # the well-known NodeIds name nothing on this device
            await call_trust_list(client, "Open", ua.Variant(READ, ua.VariantType.Byte))
        with pytest.raises(uaerrors.BadMethodInvalid):  # its methods belong to its TrustList, not another object
            await client.get_node(SERVER_CONFIGURATION).call_method(open_id, ua.Variant(READ, ua.VariantType.Byte))
        file = await client.get_node(trust_list_id).call_method(open_id, ua.Variant(READ, ua.VariantType.Byte))
        await client.get_node(trust_list_id).call_method(close_id, handle(file))
