"""The GDS push flow with each networked PKI backend: a simulated OPC UA device gets its certificate from a real EST
server (RFC 7030) or a real CMP server (``openssl cmp``), through certlm's REST API, and is renewed and decommissioned
the way that PKI does it. Swapping an entry's PKI is a PATCH of its ``pki`` and nothing else."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
from certlm_opcua_simulator import SimulatedDevice
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.serialization import pkcs12

from tests.conftest import StartDevice
from tests.crypto_factory import DEVICE_KEY_USAGE, SERVER_AND_CLIENT, ec_key, host_names
from tests.plugins.gds_push.conftest import ADMIN
from tests.plugins.pki_cmp.cmp_server import (
    CmpMockServer,
    HttpRelay,
    IssuingCmpServer,
    TestPki,
    TrustpointLike,
    http_error,
    mac_oid,
    refusing,
    requested,
)
from tests.plugins.pki_est.est_server import EstTestServer

CMP_REFERENCE, CMP_SECRET = "certlm-ra", "plant-cmp-secret"
TIMEOUTS = {
    "CERTLM_DEVICE_CONNECT_TIMEOUT_S": "3",
    "CERTLM_DEVICE_OPERATION_TIMEOUT_S": "20",
    "CERTLM_PKI_REQUEST_TIMEOUT_S": "10",
}


@pytest.fixture(scope="module")
def service_env() -> dict[str, str]:
    return TIMEOUTS


@pytest.fixture
async def est_server(tmp_path: Path) -> AsyncIterator[EstTestServer]:
    server = EstTestServer(tmp_path / "est", intermediate=True)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def device(simulated_device: StartDevice) -> SimulatedDevice:
    return await simulated_device()


async def create_pki(api: httpx.AsyncClient, **fields) -> int:
    response = await api.post("/pki/inventory", json=fields)
    assert response.status_code == 200, response.text
    return response.json()["pki_id"]


async def est_pki(api: httpx.AsyncClient, server: EstTestServer) -> int:
    return await create_pki(
        api,
        pki_type=2,
        name="plant EST",
        pki_connection=server.pki_connection,
        tls_ca=[server.tls_ca_pem],
        username=server.username,
        password=server.password,
    )


async def register(api: httpx.AsyncClient, device: SimulatedDevice, pki_id: int) -> None:
    response = await api.post("/gds/inventory", json={"server": "127.0.0.1", "port": device.config.port, "pki": pki_id})
    assert response.status_code == 200, response.text


async def push(api: httpx.AsyncClient, device: SimulatedDevice, route: str = "/gds/push/onboarding") -> dict:
    credentials = ADMIN if route.endswith("onboarding") else {}
    response = await api.post(route, json={"server": "127.0.0.1", "port": device.config.port, **credentials})
    assert response.status_code == 200, response.text
    return response.json()["result"]


def trusted_on(device: SimulatedDevice) -> set[bytes]:
    return set(device.trust_list.trusted_certificates)


def der(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.DER)


def operations(server: EstTestServer) -> list[str]:
    return [seen.operation for seen in server.requests]


async def test_est_enrolls_renews_and_serves_its_chain(
    api: httpx.AsyncClient, est_server: EstTestServer, device: SimulatedDevice
) -> None:
    pki_id = await est_pki(api, est_server)
    await register(api, device, pki_id)

    # Never validated, but with tls_ca: certlm fetches the CA certificates itself over verified TLS.
    await push(api, device)
    issued = device.certificate
    issued.verify_directly_issued_by(est_server.ca_certificates[0])
    assert issued.issuer == est_server.ca_certificates[0].subject != est_server.ca_certificate.subject
    assert {der(ca) for ca in est_server.ca_certificates} <= trusted_on(device), "the EST chain is in the trust list"
    assert operations(est_server).count("simpleenroll") == 1
    assert all(
        seen.basic_user == est_server.username for seen in est_server.requests if seen.operation == "simpleenroll"
    )
    chain = x509.load_pem_x509_certificates((await api.get(f"/pki/ca/{pki_id}")).content)
    assert chain == est_server.ca_certificates

    # The certificate came from this PKI: the next push is a re-enrollment.
    await push(api, device, "/gds/push/change")
    renewed = device.certificate
    assert renewed.serial_number != issued.serial_number and renewed.subject == issued.subject
    renewed.verify_directly_issued_by(est_server.ca_certificates[0])
    assert operations(est_server).count("simplereenroll") == 1

    # EST cannot revoke: decommissioning deletes the entry and says the certificate is not revoked.
    deleted = await api.delete(f"/gds/inventory/{quote(device.url, safe='')}")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json()["cert_revoked"] is False


@pytest.mark.parametrize(
    ("serverkeygen", "key_made_by", "last_operation"),
    [(True, "key pair made by the PKI", "serverkeygen"), (False, "certlm's is used", "simpleenroll")],
    ids=["est-server-makes-the-key", "certlm-makes-the-key"],
)
async def test_a_device_that_cannot_make_a_key_gets_one_from_est_or_certlm(
    api: httpx.AsyncClient,
    est_server: EstTestServer,
    simulated_device: StartDevice,
    serverkeygen: bool,
    key_made_by: str,
    last_operation: str,
) -> None:
    """The EST server makes the key where it offers server-side key generation; where not, certlm makes it."""
    est_server.serverkeygen = serverkeygen
    device = await simulated_device(can_create_csr=False)
    await register(api, device, await est_pki(api, est_server))
    result = await push(api, device)
    enroll_step = next(step for step in result["steps"] if step["step"] == "enroll")
    assert key_made_by in enroll_step["message"]
    assert operations(est_server)[-1] == last_operation
    assert operations(est_server).count("serverkeygen") == 1, "certlm asks the EST server for a key once"
    device.certificate.verify_directly_issued_by(est_server.ca_certificates[0])


async def test_an_est_pki_never_validated_and_without_tls_ca_is_not_trusted_blindly(
    api: httpx.AsyncClient, est_server: EstTestServer, device: SimulatedDevice
) -> None:
    pki_id = await create_pki(
        api,
        pki_type=2,
        pki_connection=est_server.pki_connection,
        username=est_server.username,
        password=est_server.password,
    )
    await register(api, device, pki_id)
    factory = device.certificate
    response = await api.post("/gds/push/onboarding", json={"server": "127.0.0.1", "port": device.config.port, **ADMIN})
    assert response.status_code == 400, response.text
    assert f"run GET /pki/exec/validate/{pki_id}" in response.json()["error"]
    assert device.certificate == factory
    assert "cacerts" not in operations(est_server)


async def test_swapping_the_pki_is_a_patch_of_the_entry(
    api: httpx.AsyncClient, est_server: EstTestServer, device: SimulatedDevice
) -> None:
    internal_id = await create_pki(api, pki_type=1, pki_connection="localhost:0", name="internal")
    await register(api, device, internal_id)
    await push(api, device)
    internal_ca = x509.load_pem_x509_certificate((await api.get(f"/pki/ca/{internal_id}")).content)
    device.certificate.verify_directly_issued_by(internal_ca)

    est_id = await est_pki(api, est_server)
    patched = await api.patch("/gds/inventory", json={"server": "127.0.0.1", "port": device.config.port, "pki": est_id})
    assert patched.status_code == 200, patched.text
    await push(api, device, "/gds/push/change")
    device.certificate.verify_directly_issued_by(est_server.ca_certificates[0])
    # The old certificate came from another PKI: a first enrollment, not a re-enrollment.
    assert operations(est_server).count("simpleenroll") == 1 and "simplereenroll" not in operations(est_server)
    entry = (await api.get(f"/gds/inventory/{quote(device.url, safe='')}")).json()
    assert entry["pki_endpoint"] == str(est_id)
    assert base64.b64decode(entry["cert_base64"]) == der(device.certificate)


def cmp_certificate_for(device: SimulatedDevice, pki: TestPki, crl_url: str) -> x509.Certificate:
    """What the CMP CA issues to the device: its subject and key, its ApplicationUri and address in the SAN, and
    where the CA publishes its CRL (a device that checks revocation wants that CRL in its trust list)."""
    current = device.certificate
    return pki.ca.issue(
        current.subject,
        current.public_key(),
        ca=False,
        days=30,
        key_usage=DEVICE_KEY_USAGE,
        extended_key_usage=SERVER_AND_CLIENT,
        san=[x509.UniformResourceIdentifier(device.application_uri), *host_names("127.0.0.1")],
        crl_url=crl_url,
        key_identifiers=True,
    )


async def serve_crl(pki: TestPki) -> HttpRelay:
    """The CA's CRL distribution point: an HTTP server answering its current CRL (a device that checks revocation
    wants the CRL of each CA of its chain in its trust list, and certlm fetches it from here)."""
    crl = pki.ca.crl(days=7).public_bytes(serialization.Encoding.DER)  # revoking nothing

    async def answer(body: bytes) -> tuple[bytes, str]:
        return crl, "application/pkix-crl"

    return await HttpRelay(answer).start()


def cmp_requests(server: CmpMockServer) -> list[str]:
    """The CMP body types the mock logged, in order."""
    return [line.split("received ", 1)[1].strip() for line in server.log().splitlines() if "DEBUG: received " in line]


@dataclass
class CmpPlant:
    """A device that keeps its key, a CMP CA whose mock server answers with the device's certificate, and the
    device registered in certlm with that CMP PKI."""

    device: SimulatedDevice
    pki: TestPki
    server: CmpMockServer
    crl_distribution_point: HttpRelay
    issued: x509.Certificate
    pki_id: int


@pytest.fixture
async def cmp_plant(
    api: httpx.AsyncClient, tmp_path: Path, simulated_device: StartDevice
) -> AsyncIterator[Callable[..., Awaitable[CmpPlant]]]:
    """Set up a ``CmpPlant``; the arguments choose how the mock hands out the CA certificate (``-rsp_extracerts``
    or ``-rsp_capubs``) and anything else it should do. The mock answers every request with one fixed certificate,
    so the device keeps its key (a secure element) and the mock is given the certificate for that key."""
    started: list[CmpPlant] = []

    async def start(chain_option: str = "-rsp_extracerts", *options: str) -> CmpPlant:
        device = await simulated_device(fixed_key=True)
        pki = TestPki.create(tmp_path / "cmp")
        crl_distribution_point = await serve_crl(pki)
        issued = cmp_certificate_for(device, pki, f"http://{crl_distribution_point.address}/ca.crl")
        server = CmpMockServer(
            tmp_path / "cmp",
            "-srv_ref", CMP_REFERENCE, "-srv_secret", f"pass:{CMP_SECRET}",
            *pki.answering(issued), chain_option, str(pki.write("ca.pem", pki.ca_certificate)),
            *options,
        ).start()  # fmt: skip
        pki_id = await create_pki(
            api, pki_type=3, name="plant CMP", pki_connection=server.address, username=CMP_REFERENCE,
            password=CMP_SECRET,
        )  # fmt: skip
        await register(api, device, pki_id)
        plant = CmpPlant(device, pki, server, crl_distribution_point, issued, pki_id)
        started.append(plant)
        return plant

    yield start
    for plant in started:
        plant.server.stop()
        await plant.crl_distribution_point.stop()


async def test_cmp_enrolls_renews_and_revokes_on_decommission(api: httpx.AsyncClient, cmp_plant) -> None:
    plant = await cmp_plant("-rsp_extracerts", "-accept_raverified")
    device, server = plant.device, plant.server
    result = await push(api, device)
    assert device.certificate == plant.issued
    assert der(plant.pki.ca_certificate) in trusted_on(device), "the chain from extraCerts is in the trust list"
    assert cmp_requests(server)[:3] == ["GENM", "P10CR", "CERTCONF"], "genm asks for the CA certificates first"
    chain = x509.load_pem_x509_certificates((await api.get(f"/pki/ca/{plant.pki_id}")).content)
    assert chain == [plant.pki.ca_certificate]
    assert result["steps"][-1]["ok"] is True

    await push(api, device, "/gds/push/change")
    assert "KUR" in cmp_requests(server)
    assert device.certificate == plant.issued

    deleted = await api.delete(f"/gds/inventory/{quote(device.url, safe='')}")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json()["cert_revoked"] is True
    assert cmp_requests(server)[-1] == "RR"


async def test_cmp_server_down_at_decommission_keeps_the_entry(api: httpx.AsyncClient, cmp_plant) -> None:
    plant = await cmp_plant()
    await push(api, plant.device)
    plant.server.stop()
    path = f"/gds/inventory/{quote(plant.device.url, safe='')}"
    refused = await api.delete(path)
    assert refused.status_code == 502, refused.text
    assert refused.json()["error"].startswith("the entry is kept: revoking its certificate")
    kept = await api.get(path)
    assert kept.status_code == 200 and kept.json()["cert_revoked"] is False


async def test_cmp_server_without_genm_and_p10cr_enrolls_a_device_that_cannot_make_keys(
    api: httpx.AsyncClient, tmp_path: Path, simulated_device: StartDevice
) -> None:
    """Issue 10's server (ir, cr, rr, certConf, pollReq; an HTTP 500 page for anything else) and a device that takes a
    pushed key: certlm makes the key and sends ir, the chain comes with the answer (caPubs), and the device applies
    and presents the certificate. Its renewal, kur being refused too, is a new ir."""
    device = await simulated_device(can_create_csr=False)
    pki = TestPki.create(tmp_path / "cmp-ir-cr")
    crl_distribution_point = await serve_crl(pki)
    pki.crl_url = f"http://{crl_distribution_point.address}/ca.crl"
    issuing = IssuingCmpServer(pki, "-srv_ref", CMP_REFERENCE, "-srv_secret", f"pass:{CMP_SECRET}")
    server = await HttpRelay(refusing(issuing.handle, {"genm", "p10cr", "kur"}, http_error())).start()
    try:
        pki_id = await create_pki(
            api, pki_type=3, name="ir/cr only", pki_connection=server.address, username=CMP_REFERENCE,
            password=CMP_SECRET,
        )  # fmt: skip
        await register(api, device, pki_id)

        result = await push(api, device)

        steps = {step["step"]: step for step in result["steps"]}
        assert "made in certlm" in steps["generate_key"]["message"]
        assert result["steps"][-1]["ok"] is True
        assert device.certificate == issuing.issued[-1]
        device.certificate.verify_directly_issued_by(pki.ca_certificate)
        assert der(pki.ca_certificate) in trusted_on(device), "the chain from caPubs is in the trust list"
        assert server.body_types == ["genm", "p10cr", "ir", "certConf"]
        learned = (await api.get(f"/pki/inventory/{pki_id}")).json()["learned_capabilities"]["cmp"]
        assert {kind: lesson["accepted"] for kind, lesson in learned.items() if kind in ("genm", "p10cr", "ir")} == {
            "genm": False,
            "p10cr": False,
            "ir": True,
        }
        assert set(learned) == {"endpoint", "mac_algorithm", "genm", "p10cr", "ir"}
        assert learned["mac_algorithm"]["name"] == "rfc9481-hmac-sha256", "OpenSSL takes RFC 9481's identifiers"
        assert learned["genm"]["answer"] == "HTTP 500: Server Error (500)"
        # The chain is cached from the enrollment: served without asking genm again.
        chain = x509.load_pem_x509_certificates((await api.get(f"/pki/ca/{pki_id}")).content)
        assert chain == [pki.ca_certificate]

        first = device.certificate
        await push(api, device, "/gds/push/change")
        assert device.certificate == issuing.issued[-1] != first
        assert device.certificate.public_key() != first.public_key(), "a new key pushed with it"
        # kur is refused and learned; p10cr and genm, learned before, are not sent again.
        assert server.body_types[4:] == ["kur", "ir", "certConf"]
    finally:
        await server.stop()
        issuing.stop()
        await crl_distribution_point.stop()


@dataclass
class TrustpointPlant:
    """A CMP server like Trustpoint 0.6 (``TrustpointLike``: ir, cr, rr, certConf and pollReq only, HTTP 500 text
    for other bodies, hmac-sha1 under RFC 4210's identifier only), issuing what each request asks for, with its CA
    chain in extraCerts and a CRL distribution point; a PKI entry for it."""

    relay: HttpRelay
    server: TrustpointLike
    issuing: IssuingCmpServer
    pki: TestPki
    pki_id: int

    def macs(self) -> list[str | None]:
        return [mac_oid(request) for request in self.server.requests]


@pytest.fixture
async def trustpoint_plant(
    api: httpx.AsyncClient, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[TrustpointPlant]]]:
    """Start a ``TrustpointPlant``; keywords are more fields of its PKI entry (``ra=True`` gives it an RA
    credential of the CA's)."""
    started: list[tuple[TrustpointPlant, HttpRelay]] = []

    async def start(*, ra: bool = False, **fields) -> TrustpointPlant:
        pki = TestPki.create(tmp_path / f"trustpoint-{len(started)}", "Trustpoint Issuing CA")
        crl_distribution_point = await serve_crl(pki)
        pki.crl_url = f"http://{crl_distribution_point.address}/ca.crl"
        issuing = IssuingCmpServer(
            pki, "-srv_ref", CMP_REFERENCE, "-srv_secret", f"pass:{CMP_SECRET}", *pki.trusted_signers(),
            "-accept_raverified", chain_option="-rsp_extracerts",
        )  # fmt: skip
        server = TrustpointLike(issuing.handle, pki.ca)
        relay = await HttpRelay(server).start()
        if ra:
            ra_key = ec_key()
            ra_certificate = pki.issue(ra_key.public_key(), "certlm-ra")
            blob = pkcs12.serialize_key_and_certificates(
                b"ra", ra_key, ra_certificate, None, serialization.BestAvailableEncryption(b"p12-pass")
            )
            fields |= {
                "est_client_pkcs12_base64": base64.b64encode(blob).decode(),
                "est_client_pkcs12_password": "p12-pass",
            }
        pki_id = await create_pki(
            api, pki_type=3, name="Trustpoint", pki_connection=relay.address, username=CMP_REFERENCE,
            password=CMP_SECRET, **fields,
        )  # fmt: skip
        plant = TrustpointPlant(relay, server, issuing, pki, pki_id)
        started.append((plant, crl_distribution_point))
        return plant

    yield start
    for plant, crl_distribution_point in started:
        await plant.relay.stop()
        plant.issuing.stop()
        await crl_distribution_point.stop()


SHA256_HMAC_9481, SHA1_HMAC_4210 = "1.2.840.113549.2.9", "1.3.6.1.5.5.8.1.2"
TRUSTPOINT_500 = "HTTP 500: An error occurred processing the CMP request."


async def test_cmp_against_trustpoint_pushes_a_key_certlm_makes_where_the_pki_entry_allows_it(
    api: httpx.AsyncClient, trustpoint_plant, device: SimulatedDevice
) -> None:
    """A device that makes its own key, a server that refuses p10cr, no RA credential: certlm makes the key, says
    why, enrolls it with ir under the MAC identifiers it negotiated, and pushes key and certificate."""
    plant = await trustpoint_plant(allow_certlm_generated_keys=True)
    await register(api, device, plant.pki_id)

    result = await push(api, device)

    names = [step["step"] for step in result["steps"]]
    assert names.index("create_signing_request") < names.index("generate_key") < names.index("enroll")
    steps = {step["step"]: step for step in result["steps"]}
    assert steps["generate_key"]["message"] == (
        f"RSA 2048 key pair made in certlm, sent as PEM: the PKI refused every request for the device's own key (p10cr "
        f"({TRUSTPOINT_500})) and PKI entry {plant.pki_id} allows keys certlm makes (allow_certlm_generated_keys)"
    )
    assert " via ir with a signature POPO for the key certlm made, MAC rfc4210-hmac-sha1" in steps["enroll"]["message"]
    assert result["steps"][-1]["ok"] is True
    # genm before the push (HTTP 500), the device's CSR as p10cr (HTTP 500), then certlm's key: ir under RFC 9481's
    # identifiers (the signed error), again under RFC 4210's, issued.
    assert plant.relay.body_types == ["genm", "p10cr", "ir", "ir", "certConf"]
    assert plant.macs()[2:] == [SHA256_HMAC_9481, SHA1_HMAC_4210, SHA1_HMAC_4210]
    device_key = requested(plant.server.requests[1]).public_key
    assert device.certificate == plant.issuing.issued[-1]
    assert device.certificate.public_key() != device_key, "the key certlm made, pushed with the certificate"
    device.certificate.verify_directly_issued_by(plant.pki.ca_certificate)
    learned = (await api.get(f"/pki/inventory/{plant.pki_id}")).json()["learned_capabilities"]["cmp"]
    assert learned["mac_algorithm"]["name"] == "rfc4210-hmac-sha1"
    assert {kind: learned[kind]["accepted"] for kind in ("genm", "p10cr", "ir")} == {
        "genm": False, "p10cr": False, "ir": True,
    }  # fmt: skip

    # The renewal: RFC 4210's identifiers from the start; kur refused once and learned, the device's CSR not sent
    # again as p10cr (refused within the day), then ir with a new key certlm makes.
    first = device.certificate
    renewal = await push(api, device, "/gds/push/change")
    assert plant.relay.body_types[5:] == ["kur", "ir", "certConf"]
    assert set(plant.macs()[5:]) == {SHA1_HMAC_4210}
    steps = {step["step"]: step for step in renewal["steps"]}
    assert f"(kur ({TRUSTPOINT_500}); p10cr ({TRUSTPOINT_500}, learned " in steps["generate_key"]["message"]
    assert device.certificate == plant.issuing.issued[-1] != first
    assert device.certificate.public_key() != first.public_key()


async def test_cmp_against_trustpoint_without_the_permission_names_both_remedies(
    api: httpx.AsyncClient, trustpoint_plant, device: SimulatedDevice
) -> None:
    plant = await trustpoint_plant()
    await register(api, device, plant.pki_id)
    factory = device.certificate

    response = await api.post("/gds/push/onboarding", json={"server": "127.0.0.1", "port": device.config.port, **ADMIN})

    assert response.status_code == 400, response.text
    assert response.json()["error"] == (
        f"enroll failed: CMP server of PKI entry {plant.pki_id} refused every request certlm could make for the "
        f"device's own key: p10cr ({TRUSTPOINT_500}). To enroll, configure an RA certificate (est_client_pkcs12_base64)"
        f" so that certlm sends cr with raVerified, or allow keys certlm makes on the PKI entry (PATCH /pki/inventory/"
        f'{plant.pki_id} {{"allow_certlm_generated_keys": true}}) so that certlm makes the key, sends ir with a '
        "signature POPO and pushes the key to the device with the certificate"
    )
    failed = response.json()["result"]["steps"][-1]
    assert (failed["step"], failed["ok"]) == ("enroll", False)
    assert "generate_key" not in [step["step"] for step in response.json()["result"]["steps"]]
    assert device.certificate == factory
    assert plant.relay.body_types == ["genm", "p10cr"]


async def test_cmp_against_trustpoint_and_a_device_that_takes_no_pushed_key(
    api: httpx.AsyncClient, trustpoint_plant, simulated_device: StartDevice
) -> None:
    device = await simulated_device(private_key_formats=())
    plant = await trustpoint_plant(allow_certlm_generated_keys=True)
    await register(api, device, plant.pki_id)
    factory = device.certificate

    response = await api.post("/gds/push/onboarding", json={"server": "127.0.0.1", "port": device.config.port, **ADMIN})

    assert response.status_code == 500, response.text
    failed = response.json()["result"]["steps"][-1]
    assert (failed["step"], failed["ok"], failed["status"]) == ("generate_key", False, "BadNotSupported")
    assert failed["message"].endswith(
        "for one that does not, configure an RA certificate (est_client_pkcs12_base64) so that certlm sends cr with "
        "raVerified. This device takes no private key in a format certlm sends"
    )
    assert device.certificate == factory
    assert plant.relay.body_types == ["genm", "p10cr"]


async def test_cmp_against_trustpoint_with_an_ra_credential_keeps_the_device_key(
    api: httpx.AsyncClient, trustpoint_plant, device: SimulatedDevice
) -> None:
    plant = await trustpoint_plant(ra=True, allow_certlm_generated_keys=True)
    await register(api, device, plant.pki_id)

    result = await push(api, device)

    steps = {step["step"]: step for step in result["steps"]}
    assert "generate_key" not in steps, "the RA vouches for the device's own key"
    assert steps["enroll"]["message"].endswith(
        " via cr with POPO raVerified, certlm vouching for the device's CSR as RA, signed with the client certificate; "
        f"the server refused p10cr ({TRUSTPOINT_500})"
    )
    assert plant.relay.body_types == ["genm", "p10cr", "cr", "certConf"]
    assert plant.macs() == [None, None, None, None], "every request signed with the RA credential"
    assert device.certificate == plant.issuing.issued[-1]
    assert device.certificate.public_key() == requested(plant.server.requests[1]).public_key, "the device's key"


async def test_a_certificate_without_its_chain_never_reaches_the_device(api: httpx.AsyncClient, cmp_plant) -> None:
    # openssl's mock puts -rsp_capubs only into ip answers: a p10cr gets the certificate alone.
    plant = await cmp_plant("-rsp_capubs")
    device = plant.device
    factory = device.certificate
    response = await api.post("/gds/push/onboarding", json={"server": "127.0.0.1", "port": device.config.port, **ADMIN})
    assert response.status_code == 500, response.text
    assert "sent no certificate of its issuer" in response.json()["error"]
    assert response.json()["result"]["device_changed"] is False
    assert response.json()["result"]["steps"][-1]["step"] == "enroll"
    assert device.certificate == factory


async def test_a_cmp_pki_without_credentials_is_named_before_the_device_is_touched(
    api: httpx.AsyncClient, cmp_plant
) -> None:
    plant = await cmp_plant()
    # Stored without its MAC secret (what an operator may do first and complete later).
    cleared = await api.patch(f"/pki/inventory/{plant.pki_id}", json={"password": None})
    assert cleared.status_code == 200, cleared.text
    factory = plant.device.certificate

    response = await api.post(
        "/gds/push/onboarding", json={"server": "127.0.0.1", "port": plant.device.config.port, **ADMIN}
    )

    assert response.status_code == 400, response.text
    assert response.json()["error"].startswith(
        f"PKI entry {plant.pki_id} (CMP) has no password: set password (the MAC secret"
    )
    assert plant.device.certificate == factory
    assert cmp_requests(plant.server) == []


async def test_a_failed_push_stores_only_the_credentials_the_device_accepted(
    make_service, est_server: EstTestServer, device: SimulatedDevice, simulated_device: StartDevice
) -> None:
    """A failed push changes nothing but what the spec keeps: the credentials the device accepted. A service of its
    own, so that the EST entry below is the only PKI a new device can be given."""
    service = await make_service(env=TIMEOUTS)
    async with service.client() as api:
        await _push_failures_change_nothing_else(api, est_server, device, simulated_device)


async def _push_failures_change_nothing_else(
    api: httpx.AsyncClient, est_server: EstTestServer, device: SimulatedDevice, simulated_device: StartDevice
) -> None:
    pki_without_credentials = await create_pki(
        api, pki_type=2, pki_connection=est_server.pki_connection, tls_ca=[est_server.tls_ca_pem]
    )
    await register(api, device, pki_without_credentials)
    address = f"127.0.0.1:{device.config.port}"
    before = (await api.get(f"/gds/inventory/{address}")).json()
    asked = {"name": "Press 9", "security_policy": 8, "security_mode": 2}
    response = await api.post(
        "/gds/push/onboarding", json={"server": "127.0.0.1", "port": device.config.port, **ADMIN, **asked}
    )
    assert response.status_code == 400, response.text
    after = (await api.get(f"/gds/inventory/{address}")).json()
    assert {key: after[key] for key in (*asked, "pki_endpoint")} == {
        key: before[key] for key in (*asked, "pki_endpoint")
    }
    assert (before["username"], after["username"]) == (None, ADMIN["username"])  # the device accepted it

    # A device the push registered is not left behind when it never accepted the connection ...
    newcomer = await simulated_device()
    newcomer_address = {"server": "127.0.0.1", "port": newcomer.config.port}
    wrong_password = {"username": "admin", "password": "not-the-password"}
    response = await api.post("/gds/push", json={**newcomer_address, **wrong_password, **asked})
    assert response.status_code == 500, response.text
    missing = await api.get(f"/gds/inventory/127.0.0.1:{newcomer.config.port}")
    assert missing.status_code == 404, missing.text
    # ... and when it did, it stays registered with the credentials it accepted, not the settings asked for.
    response = await api.post("/gds/push", json={**newcomer_address, **ADMIN, **asked})
    assert response.status_code == 400, response.text
    registered = (await api.get(f"/gds/inventory/127.0.0.1:{newcomer.config.port}")).json()
    assert registered["username"] == ADMIN["username"]
    assert (registered["name"], registered["security_policy"], registered["security_mode"]) != (
        asked["name"], asked["security_policy"], asked["security_mode"]
    )  # fmt: skip
    assert newcomer.installed_certificates == []


async def test_an_est_pki_without_credentials_is_named_when_the_push_enrolls(
    api: httpx.AsyncClient, est_server: EstTestServer, device: SimulatedDevice
) -> None:
    # Its CA certificates need no credentials (RFC 7030 4.1.1); enrolling does.
    pki_id = await create_pki(api, pki_type=2, pki_connection=est_server.pki_connection, tls_ca=[est_server.tls_ca_pem])
    await register(api, device, pki_id)
    factory = device.certificate
    response = await api.post("/gds/push/onboarding", json={"server": "127.0.0.1", "port": device.config.port, **ADMIN})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert f"PKI entry {pki_id}" in error and "username" in error and "password" in error
    failed = response.json()["result"]["steps"][-1]
    assert (failed["step"], failed["ok"]) == ("enroll", False) and failed["status"]
    assert response.json()["result"]["device_changed"] is False
    assert device.certificate == factory
    assert "simpleenroll" not in operations(est_server)
