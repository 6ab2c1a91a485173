"""Approving a client a device rejected, end to end on certlm's app against the independent node-opcua peer
(``/work/shared/peers/node-opcua-gds``): onboarded by certlm, then refusing unknown clients (``AUTO_ACCEPT=0``), it
refuses a SCADA client with its own certificate and lists it (GetRejectedList); the monitor finds it, the operator
approves it through the API, and the client connects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from certlm.contracts.enrollment import CLIENT_PROFILE
from certlm.lifecycle.monitoring import monitor_device
from certlm.storage.models import InventoryEntry, PkiEntry
from certlm.testing.pushes import create_internal_ca
from certlm.testing.running import eventually
from tests.plugins.gds_push.conftest import ADMIN, NodeOpcuaPeer
from tests.support import InProcessApp
from tests.test_rejected_clients_driver import ScadaClient


@pytest_asyncio.fixture
async def peer(tmp_path: Path) -> AsyncIterator[NodeOpcuaPeer]:
    peer = NodeOpcuaPeer(pki_dir=tmp_path / "pki", log_path=tmp_path / "peer.log")
    await asyncio.to_thread(peer.start)
    try:
        yield peer
    finally:
        await asyncio.to_thread(peer.stop)


async def test_node_opcua_refuses_a_client_certlm_finds_approves_and_the_client_then_connects(
    in_process: InProcessApp, peer: NodeOpcuaPeer
) -> None:
    await create_internal_ca(in_process, "Plant CA")
    status, body = await in_process.call(
        "POST", "/gds/push/onboarding", {"server": "127.0.0.1", "port": peer.port, **ADMIN}
    )
    assert status == 200, body
    # From now on the peer refuses every client it does not trust (certlm's is, since onboarding).
    await asyncio.to_thread(peer.restart, AUTO_ACCEPT="0")
    scada = ScadaClient()
    assert await scada.connect(peer.url) != "Good"
    assert any(path.read_bytes() for path in peer.rejected_dir.glob("*.pem"))

    async with in_process.context():
        entry = await InventoryEntry.get(port=peer.port, protocol="gds")
        assert await monitor_device(in_process.host.runtime, entry, datetime.now(UTC)) == "read"
    status, page = await in_process.call("GET", f"/gds/rejected?device=127.0.0.1:{peer.port}")
    assert status == 200, page
    (found,) = [item for item in page["rejected"] if item["application_uri"] == scada.application_uri]
    assert found["state"] == "waiting" and found["device"] == peer.url

    status, approved = await in_process.call("POST", f"/gds/rejected/{found['id']}/approve", {})
    assert status == 200, approved
    assert approved["trusted"]["verified"] is True and approved["trusted"]["written"] is True
    trusted = {path.read_bytes() for path in (peer.pki_dir / "own_pki" / "trusted" / "certs").glob("*.pem")}
    assert scada.certificate.public_bytes(serialization.Encoding.PEM).strip() in {pem.strip() for pem in trusted}

    async def connects() -> bool:
        return await scada.connect(peer.url) == "Good"

    # The peer drops every channel about 2 s after ApplyChanges and reopens them.
    await eventually(connects, "the approved client connecting to node-opcua", timeout=30)
    # node-opcua took it out of its rejected folder (AddCertificate): the next read no longer lists it.
    async with in_process.context():
        entry = await InventoryEntry.get(port=peer.port, protocol="gds")
        assert await monitor_device(in_process.host.runtime, entry, datetime.now(UTC)) == "read"
    (listed,) = (await in_process.call("GET", "/gds/rejected"))[1]["rejected"]
    assert listed["state"] == "approved" and listed["listed"] is False


async def test_node_opcua_lets_a_client_in_once_its_issuer_is_approved(
    in_process: InProcessApp, peer: NodeOpcuaPeer
) -> None:
    """A client issued by a CA certlm holds as a PKI entry: approving the issuer trusts that CA (with its CRL), and
    node-opcua, which refuses what lies in its rejected/ folder before it looks at the issuer, gets the client's
    certificate released from there by the write (AddCertificate), so that the CA decides."""
    await create_internal_ca(in_process, "Plant CA")
    scada_ca = await create_internal_ca(in_process, "SCADA CA")
    status, body = await in_process.call(
        "POST", "/gds/push/onboarding", {"server": "127.0.0.1", "port": peer.port, **ADMIN}
    )
    assert status == 200, body
    await asyncio.to_thread(peer.restart, AUTO_ACCEPT="0")
    scada = ScadaClient()
    async with in_process.context():
        scada.certificate = await issued_by_pki_entry(in_process, scada_ca.pki_id, scada)
    assert await scada.connect(peer.url) != "Good"

    async with in_process.context():
        entry = await InventoryEntry.get(port=peer.port, protocol="gds")
        assert await monitor_device(in_process.host.runtime, entry, datetime.now(UTC)) == "read"
    status, page = await in_process.call("GET", "/gds/rejected")
    (found,) = [item for item in page["rejected"] if item["application_uri"] == scada.application_uri]
    status, approved = await in_process.call("POST", f"/gds/rejected/{found['id']}/approve", {"trust": "issuer"})
    assert status == 200, approved
    assert approved["trusted"]["certificate"]["subject"] == scada_ca.certificate.subject.rfc4514_string()
    assert approved["trusted"]["verified"] is True

    async def connects() -> bool:
        return await scada.connect(peer.url) == "Good"

    await eventually(connects, "a client of the approved CA connecting to node-opcua", timeout=30)
    trusted = {path.read_bytes().strip() for path in (peer.pki_dir / "own_pki" / "trusted" / "certs").glob("*.pem")}
    assert scada.certificate.public_bytes(serialization.Encoding.PEM).strip() not in trusted


async def issued_by_pki_entry(in_process: InProcessApp, pki_id: int, client: ScadaClient) -> x509.Certificate:
    """The client's certificate as the internal CA of PKI entry ``pki_id`` issues it (the client profile)."""
    entry = await PkiEntry.get(id=pki_id)
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(client.certificate.subject)
        .add_extension(client.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value, False)
        .sign(client.key, hashes.SHA256())
    )
    backend = in_process.host.runtime.pki_backends.get(entry.pki_type)
    return (await backend.enroll(entry, csr, CLIENT_PROFILE)).certificate
