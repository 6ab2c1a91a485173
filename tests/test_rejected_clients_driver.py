"""The GDS push driver's ``read_rejected_list`` (ServerConfiguration.GetRejectedList) against the simulated PLC and
the node-opcua peer: a real asyncua client with a self-signed certificate of its own is refused, the device lists it,
the driver reads it (also in the monitor's one session, ``read_device``), and once the device trusts it, it connects."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from asyncua import Client, ua
from asyncua.crypto import security_policies
from certlm_gds_push.driver import GdsPushDriver
from certlm_gds_push.identity import ClientIdentity
from certlm_gds_push.rejected_list import _certificates_in
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certlm import DeviceFailure, HostServices, TrustList, UnsupportedOperation, to_der
from certlm.testing.running import eventually
from tests.conftest import StartDevice
from tests.crypto_factory import certificate, name, rsa_key
from tests.plugins.gds_push.conftest import (  # noqa: F401  (session fixtures used by name)
    ADMIN,
    NodeOpcuaPeer,
    OpcUaTestCa,
    client_identity,
    device_target,
    driver,
    driver_for,
    make_client_identity,
    node_opcua_peer,
    opcua_certificate_options,
    opcua_test_ca,
    services,
    target_for,
)

SCADA_URI = "urn:plant:scada:hmi-7"


class ScadaClient:
    """An OPC UA client application of its own (a SCADA station): a self-signed certificate and key, connecting
    with plain asyncua on Basic256Sha256/SignAndEncrypt as anonymous."""

    def __init__(self, application_uri: str = SCADA_URI, issuer: OpcUaTestCa | None = None) -> None:
        self.application_uri = application_uri
        self.key = rsa_key()
        san = x509.SubjectAlternativeName(
            [x509.UniformResourceIdentifier(application_uri), x509.DNSName(socket.gethostname())]
        )
        subject = name("SCADA HMI 7", organization="plant")
        if issuer is None:
            self.certificate = certificate(
                subject, self.key.public_key(), self.key, **opcua_certificate_options(san, self_signed=True)
            )
        else:
            self.certificate = issuer.issue(subject, self.key.public_key(), san=san)

    async def connect(self, url: str) -> str:
        """``Good`` when a secure session opens, else the status that refused it."""
        client = Client(url, timeout=5)
        client.application_uri = self.application_uri
        await client.set_security(
            security_policies.SecurityPolicyBasic256Sha256,
            self.certificate.public_bytes(serialization.Encoding.DER),
            self.key.private_bytes(
                serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
            mode=ua.MessageSecurityMode.SignAndEncrypt,
        )
        try:
            await client.connect()
        except ua.UaStatusCodeError as error:
            return ua.StatusCode(error.code).name
        except (TimeoutError, ConnectionError, OSError) as error:
            return f"{type(error).__name__}: {error}"
        await client.disconnect()
        return "Good"


REFUSED = ("BadCertificateUntrusted", "BadSecurityChecksFailed")


@pytest.fixture
def strict_peer(node_opcua_peer: NodeOpcuaPeer) -> Iterator[NodeOpcuaPeer]:  # noqa: F811
    with node_opcua_peer.restarted(AUTO_ACCEPT="0") as peer:
        yield peer


def test_a_chain_entry_comes_out_as_its_certificates_and_junk_is_refused(opcua_test_ca: OpcUaTestCa) -> None:  # noqa: F811
    client = ScadaClient(issuer=opcua_test_ca)
    chain = to_der(client.certificate) + to_der(opcua_test_ca.certificate)
    assert _certificates_in(chain, 0) == [client.certificate, opcua_test_ca.certificate]
    for junk in (b"\x30\x82\xff\xff", b"junk", to_der(client.certificate)[:-1], to_der(client.certificate) + b"\x00"):
        with pytest.raises(DeviceFailure, match="GetRejectedList entry 3 is not DER certificates"):
            _certificates_in(junk, 3)


async def test_the_simulator_lists_a_refused_client_and_lets_it_in_once_trusted(
    simulated_device: StartDevice,
    driver: GdsPushDriver,  # noqa: F811
    client_identity: ClientIdentity,  # noqa: F811
    opcua_test_ca: OpcUaTestCa,  # noqa: F811
) -> None:
    device = await simulated_device(auto_accept=False, trusted_client_certificates=(client_identity.certificate_der,))
    admin = device_target(device, **ADMIN)
    assert await driver.read_rejected_list(admin) == []
    scada = ScadaClient()
    assert await scada.connect(device.url) in REFUSED
    assert await driver.read_rejected_list(admin) == [scada.certificate]
    reading = await driver.read_device(admin)
    assert reading.rejected_certificates == [scada.certificate]

    current = await driver.read_trust_list(admin, TrustList.ALL)
    current.trusted_certificates.append(to_der(scada.certificate))
    after = await driver.write_trust_list(admin, current)
    assert after is not None and to_der(scada.certificate) in after.trusted_certificates
    # The device drops every channel once the changes are applied and listens again (apply_delay_s later): a client
    # that connects in between is cut off, as at a real PLC; connect once the endpoints are open again.
    await device.settle()
    assert await scada.connect(device.url) == "Good"


async def test_the_simulator_refusing_get_rejected_list_is_said_plainly(
    simulated_device: StartDevice,
    driver: GdsPushDriver,  # noqa: F811
) -> None:
    device = await simulated_device(fail_at="get_rejected_list:BadNotSupported")
    admin = device_target(device, **ADMIN)
    with pytest.raises(
        UnsupportedOperation, match=r"does not list the client certificates it rejected.*BadNotSupported"
    ):
        await driver.read_rejected_list(admin)
    # The monitor's visit goes on without it.
    reading = await driver.read_device(admin)
    assert reading.rejected_certificates is None and reading.trust_list is not None
    operator = device_target(device, username="operator", password="operator-pw")
    with pytest.raises(UnsupportedOperation, match="BadUserAccessDenied"):
        await driver.read_rejected_list(operator)


async def test_node_opcua_lists_a_refused_client(
    strict_peer: NodeOpcuaPeer,
    services: HostServices,  # noqa: F811
    client_identity: ClientIdentity,  # noqa: F811
) -> None:
    peer_driver = driver_for(GdsPushDriver, client_identity, services)
    admin = target_for(strict_peer.url, strict_peer.port, **ADMIN)
    scada = ScadaClient()
    # node-opcua refuses in OpenSecureChannel with an ERR message asyncua reports as a connection error.
    assert await scada.connect(strict_peer.url) != "Good"
    assert scada.certificate in await peer_driver.read_rejected_list(admin)
    assert scada.certificate in (await peer_driver.read_device(admin)).rejected_certificates
    operator = target_for(strict_peer.url, strict_peer.port, username="operator", password="operator-pw")
    with pytest.raises(UnsupportedOperation, match="BadUserAccessDenied"):
        await peer_driver.read_rejected_list(operator)


async def test_node_opcua_lets_a_rejected_client_in_once_the_trust_list_holds_it(
    strict_peer: NodeOpcuaPeer,
    services: HostServices,  # noqa: F811
    client_identity: ClientIdentity,  # noqa: F811
) -> None:
    """node-opcua refuses a certificate in its rejected/ folder whatever its trusted folder holds: the write releases
    it with AddCertificate first (without that, this test fails with the client refused for good)."""
    peer_driver = driver_for(GdsPushDriver, client_identity, services)
    admin = target_for(strict_peer.url, strict_peer.port, **ADMIN)
    scada = ScadaClient()
    assert await scada.connect(strict_peer.url) != "Good"
    current = await peer_driver.read_trust_list(admin, TrustList.ALL)
    current.trusted_certificates.append(to_der(scada.certificate))
    after = await peer_driver.write_trust_list(admin, current)
    assert after is not None and to_der(scada.certificate) in after.trusted_certificates
    # The peer drops every channel about 2 s after ApplyChanges and reopens them.
    await eventually(lambda: _connects(scada, strict_peer.url), "the approved client connecting", timeout=20)
    assert scada.certificate not in await peer_driver.read_rejected_list(admin)


async def _connects(client: ScadaClient, url: str) -> bool:
    return await client.connect(url) == "Good"
