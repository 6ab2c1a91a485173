"""``SshStoreDriver.write_trust_list`` and a push's ``also_trusted`` against the real test device: the trust
directories end up holding exactly the list (checked on the device's disk), certlm's files added and whatever the list
drops removed, the operator's files kept while the list keeps them, the server reloaded; a list that is no list, a
changed host key, an unreadable store, a refused reload and a device gone in the middle of the upload leave the store
as it was."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from certlm_ssh.driver import SshStoreDriver
from certlm_ssh.opcua import presented_certificate
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import Encoding

from certlm import DeviceFailure, DeviceIdentityChanged, DeviceTarget, PushFailed, PushRequest, TrustList
from certlm.inventory.entries import find_entry_at
from certlm.pki.material import enrollment_pki, pki_material
from tests.crypto_factory import make_ca
from tests.plugins.ssh.conftest import SshPlant, store_files
from tests.plugins.ssh.device import StoreDevice
from tests.support import eventually

# Where the test device keeps each list (the entry's layout leaves ssh-generic's directories).
DIRECTORIES = {
    "trusted_certificates": "trusted/certs",
    "trusted_crls": "trusted/crl",
    "issuer_certificates": "issuer/certs",
    "issuer_crls": "issuer/crl",
}


async def onboarded(plant: SshPlant) -> StoreDevice:
    [device] = plant.bed.devices
    await plant.register(device)
    await plant.onboard(device)
    return device


@asynccontextmanager
async def ssh_driver(plant: SshPlant, device: StoreDevice) -> AsyncIterator[tuple[SshStoreDriver, DeviceTarget]]:
    """The entry's driver and target, as the host hands them to a campaign, in the app's context."""
    async with plant.context():
        entry = await find_entry_at("127.0.0.1", device.ssh_port, "ssh")
        assert entry is not None
        runtime = plant.host.runtime
        yield runtime.drivers.get(entry.service), await runtime.inventory.device_target(entry)


def on_disk(device: StoreDevice) -> dict[str, set[bytes]]:
    """The device's trust list as its disk holds it: the DER of every certificate or CRL file of each directory."""
    held: dict[str, set[bytes]] = {}
    for part, directory in DIRECTORIES.items():
        held[part] = set()
        for path in (device.store / directory).iterdir():
            data = path.read_bytes()
            pem = data.startswith(b"-----BEGIN")
            try:
                if part.endswith("crls"):
                    loaded = x509.load_pem_x509_crl(data) if pem else x509.load_der_x509_crl(data)
                else:
                    loaded = x509.load_pem_x509_certificate(data) if pem else x509.load_der_x509_certificate(data)
            except ValueError:
                continue
            held[part].add(loaded.public_bytes(Encoding.DER))
    return held


def as_sets(trust_list: TrustList) -> dict[str, set[bytes]]:
    return {part: set(getattr(trust_list, part)) for part in DIRECTORIES}


def with_added(trust_list: TrustList, **added: list[bytes]) -> TrustList:
    return TrustList(**{part: [*getattr(trust_list, part), *added.get(part, [])] for part in DIRECTORIES})


def without(trust_list: TrustList, *removed: bytes) -> TrustList:
    return TrustList(**{part: [i for i in getattr(trust_list, part) if i not in removed] for part in DIRECTORIES})


def server_pid(device: StoreDevice) -> str:
    return (device.directory / "server.pid").read_text()


def certlm_files(device: StoreDevice, directory: str, der: bytes) -> list[str]:
    """certlm's files of ``der`` in the store's ``directory``, named by its SHA-1 (in the layout's trust format)."""
    digest = hashes.Hash(hashes.SHA1())
    digest.update(der)
    return [path.name for path in (device.store / directory).glob(f"certlm-{digest.finalize().hex()}.*")]


def another_issuer(name: str = "Next issuer CA") -> tuple[bytes, bytes]:
    """Another CA's certificate and CRL (DER): the new issuer a campaign adds."""
    ca = make_ca(name)
    return ca.certificate.public_bytes(Encoding.DER), ca.crl().public_bytes(Encoding.DER)


async def test_a_write_adds_a_ca_and_its_crl_takes_them_into_use_and_a_later_write_removes_them(
    plant: SshPlant,
) -> None:
    device = await onboarded(plant)
    ca, crl = another_issuer()
    async with ssh_driver(plant, device) as (driver, target):
        before = await driver.read_trust_list(target, TrustList.ALL)
        pid = server_pid(device)

        added = with_added(before, trusted_certificates=[ca], trusted_crls=[crl])
        written = await driver.write_trust_list(target, added)

        expected = as_sets(added)
        assert as_sets(written) == expected
        assert on_disk(device) == expected
        # certlm's own files, in the PEM the device's driver (ssh-debian-opcua-server) writes.
        assert len(certlm_files(device, "trusted/certs", ca)) == 1 and certlm_files(device, "trusted/crl", crl)
        # Taken into use as a push does: the reload restarted the server, which presents its certificate again.
        assert server_pid(device) != pid
        assert await presented_certificate(device.opcua_url, 5) == device.installed_certificate()
        # The generation before is kept for a rollback, without the new issuer.
        assert not certlm_files(device, ".certlm-previous/trusted/certs", ca)

        pid = server_pid(device)
        removed = await driver.write_trust_list(target, before)

        assert as_sets(removed) == as_sets(before) == on_disk(device)
        assert not certlm_files(device, "trusted/certs", ca) and not certlm_files(device, "trusted/crl", crl)
        assert server_pid(device) != pid

        # A list the store holds already changes nothing: no swap, no reload.
        pid, files = server_pid(device), store_files(device)
        assert as_sets(await driver.write_trust_list(target, before)) == as_sets(before)
        assert server_pid(device) == pid and store_files(device) == files


async def test_the_operators_files_stay_while_the_list_keeps_them_and_go_only_when_it_drops_them(
    plant: SshPlant,
) -> None:
    device = await onboarded(plant)
    # The operator's own files: the trusted SCADA client the device came with (DER), an issuer in PEM, and a note
    # that is no certificate at all.
    operator_issuer = make_ca("Plant issuer CA").certificate
    (device.store / "issuer" / "certs" / "plant-issuer.pem").write_bytes(operator_issuer.public_bytes(Encoding.PEM))
    (device.store / "trusted" / "certs" / "README").write_text("trusted SCADA clients of line 3\n")
    scada = (device.store / "trusted" / "certs" / "scada-client.der").read_bytes()
    ca, crl = another_issuer()
    async with ssh_driver(plant, device) as (driver, target):
        before = await driver.read_trust_list(target, TrustList.ALL)
        assert operator_issuer.public_bytes(Encoding.DER) in before.issuer_certificates
        assert scada in before.trusted_certificates

        added = with_added(before, trusted_certificates=[ca], trusted_crls=[crl])
        await driver.write_trust_list(target, added)

        # Kept as they were, and not written a second time as certlm's.
        assert (device.store / "trusted" / "certs" / "scada-client.der").read_bytes() == scada
        assert (device.store / "issuer" / "certs" / "plant-issuer.pem").exists()
        assert [path.name for path in (device.store / "issuer" / "certs").iterdir()] == ["plant-issuer.pem"]
        assert (device.store / "trusted" / "certs" / "README").exists()

        # The caller drops the SCADA client's certificate: its file goes, kept with the previous generation.
        written = await driver.write_trust_list(target, without(added, scada))

        assert scada not in written.trusted_certificates and scada not in on_disk(device)["trusted_certificates"]
        assert not (device.store / "trusted" / "certs" / "scada-client.der").exists()
        assert (device.store / ".certlm-previous" / "trusted" / "certs" / "scada-client.der").read_bytes() == scada
        assert (device.store / "issuer" / "certs" / "plant-issuer.pem").exists()
        assert (device.store / "trusted" / "certs" / "README").exists()  # no part of the trust list


async def test_no_list_locks_certlm_out_as_its_login_and_endpoint_read_need_no_trust_entry(plant: SshPlant) -> None:
    device = await onboarded(plant)
    async with ssh_driver(plant, device) as (driver, target):
        # Not even certlm's own CA: certlm logs in over SSH and reads the endpoint's certificate without a session.
        emptied = await driver.write_trust_list(target, TrustList())

        assert as_sets(emptied) == as_sets(TrustList()) == on_disk(device)
        assert as_sets(await driver.read_trust_list(target, TrustList.ALL)) == as_sets(TrustList())
    renewed = await plant.push(device)
    assert renewed["success"], renewed
    assert len(on_disk(device)["trusted_certificates"]) == 1  # the push wrote its CA again


async def test_a_list_that_is_no_list_of_certificates_and_crls_is_refused_before_anything_is_sent(
    plant: SshPlant,
) -> None:
    device = await onboarded(plant)
    ca, crl = another_issuer()
    files = store_files(device)
    async with ssh_driver(plant, device) as (driver, target):
        before = await driver.read_trust_list(target, TrustList.ALL)
        assert len(before.trusted_certificates) == 2  # certlm's CA and the operator's SCADA client
        # The device is down: a write that tried to reach it would fail on the connection, not on the list.
        await asyncio.to_thread(plant.bed.sshd.stop)
        wrong_lists = {
            "trusted_certificates[2] is no DER certificate": with_added(before, trusted_certificates=[crl, ca]),
            "issuer_crls[0] is no DER CRL": with_added(before, trusted_certificates=[ca], issuer_crls=[b"not a CRL"]),
        }

        for named, wrong in wrong_lists.items():
            with pytest.raises(DeviceFailure) as refused:
                await driver.write_trust_list(target, wrong)

            assert refused.value.device_status == "BadCertificateInvalid", refused.value.message
            assert refused.value.message == (
                f"the trust list to write to ssh://127.0.0.1:{device.ssh_port} is refused: {named}"
            )
    assert store_files(device) == files


async def test_a_changed_host_key_is_refused_and_nothing_is_written(plant: SshPlant) -> None:
    device = await onboarded(plant)
    ca, crl = another_issuer()
    files = store_files(device)
    sshd = plant.bed.sshd
    async with ssh_driver(plant, device) as (driver, target):
        before = await driver.read_trust_list(target, TrustList.ALL)
        await asyncio.to_thread(sshd.stop)
        sshd.new_host_key()
        await asyncio.to_thread(sshd.start)

        with pytest.raises(DeviceIdentityChanged) as changed:
            await driver.write_trust_list(target, with_added(before, trusted_certificates=[ca], trusted_crls=[crl]))

    assert f"presented ssh-ed25519 {sshd.host_key_fingerprint()}" in changed.value.message
    assert "certlm sent it nothing" in changed.value.message
    assert store_files(device) == files


async def test_a_store_directory_the_login_cannot_read_is_refused_before_anything_changes(plant: SshPlant) -> None:
    device = await onboarded(plant)
    ca, crl = another_issuer()
    files = store_files(device)
    crl_directory = device.store / "trusted" / "crl"
    async with ssh_driver(plant, device) as (driver, target):
        before = await driver.read_trust_list(target, TrustList.ALL)
        # Writable and enterable, but not listable: what it holds, and so what to remove, cannot be known.
        crl_directory.chmod(0o311)
        try:
            with pytest.raises(DeviceFailure) as refused:
                await driver.write_trust_list(target, with_added(before, trusted_certificates=[ca], trusted_crls=[crl]))
        finally:
            crl_directory.chmod(0o755)

    assert "failed before it changed the store" in refused.value.message, refused.value.message
    assert "the device keeps its trust list" in refused.value.message
    assert store_files(device) == files


async def test_a_refused_reload_restores_the_previous_trust_list(plant: SshPlant) -> None:
    device = await onboarded(plant)
    ca, crl = another_issuer()
    scada = (device.store / "trusted" / "certs" / "scada-client.der").read_bytes()
    files = store_files(device)
    async with ssh_driver(plant, device) as (driver, target):
        before = await driver.read_trust_list(target, TrustList.ALL)
        (device.directory / "reject-next").touch()

        # Adds an issuer and drops the operator's SCADA client: both undone.
        with pytest.raises(DeviceFailure) as failed:
            await driver.write_trust_list(
                target, without(with_added(before, trusted_certificates=[ca], trusted_crls=[crl]), scada)
            )

        assert failed.value.device_status == "CommandFailed", failed.value.message
        assert "refused" in failed.value.message and "the previous trust list was restored" in failed.value.message
        assert "the server presents its certificate again" in failed.value.message
        assert store_files(device) == files
        assert on_disk(device) == as_sets(before) == as_sets(await driver.read_trust_list(target, TrustList.ALL))
    assert await presented_certificate(device.opcua_url, 5) == device.installed_certificate()


@pytest.mark.parametrize("certlm_settings", [{"device_connect_timeout_s": 15.0, "device_operation_timeout_s": 30.0}])
async def test_the_device_going_down_during_the_upload_leaves_the_old_list_in_force(plant: SshPlant) -> None:
    device = await onboarded(plant)
    ca, crl = another_issuer()
    scada = (device.store / "trusted" / "certs" / "scada-client.der").read_bytes()
    files = store_files(device)
    base = plant.bed.base
    async with ssh_driver(plant, device) as (driver, target):
        before = await driver.read_trust_list(target, TrustList.ALL)
        # A write that adds an issuer and drops the operator's SCADA client. Its SFTP sessions read the four trust
        # directories and the certificate, then upload: the sixth waits in the device while this exists (the count
        # starts now).
        (base / "sftp-count").unlink(missing_ok=True)
        (base / "hold-sftp").write_text("6")
        changed = without(with_added(before, trusted_certificates=[ca], trusted_crls=[crl]), scada)
        write = asyncio.create_task(driver.write_trust_list(target, changed))

        async def upload_started_or_write_ended() -> bool:
            return (base / "sftp-started").exists() or write.done()

        await eventually(upload_started_or_write_ended, "the upload to start", timeout=60)
        assert not write.done(), f"the write ended before its upload started: {write.exception()}"
        await asyncio.to_thread(plant.bed.sshd.stop)
        (base / "hold-sftp").unlink()
        with pytest.raises(DeviceFailure) as failed:
            await asyncio.wait_for(write, 60)

    assert "failed before it changed the store" in failed.value.message, failed.value.message
    assert store_files(device) == files and on_disk(device) == as_sets(before)
    assert await presented_certificate(device.opcua_url, 5) == device.installed_certificate()


async def test_a_push_keeps_what_also_trusted_holds_and_reports_it(plant: SshPlant) -> None:
    device = await onboarded(plant)
    ca, crl = another_issuer()
    intermediate, intermediate_crl = another_issuer("Next issuing CA")
    also = TrustList(
        trusted_certificates=[ca], trusted_crls=[crl], issuer_certificates=[intermediate],
        issuer_crls=[intermediate_crl],
    )  # fmt: skip
    async with ssh_driver(plant, device) as (driver, target):
        # The campaign added the new issuer first; the renewals that follow keep it.
        current = await driver.read_trust_list(target, TrustList.ALL)
        await driver.write_trust_list(target, with_added(current, **vars(also)))
        runtime = plant.host.runtime
        entry = await find_entry_at("127.0.0.1", device.ssh_port, "ssh")
        assert entry is not None
        pki = await enrollment_pki(entry, runtime.pki_backends)
        material = await pki_material(pki, entry, runtime.pki_backends, runtime.services, runtime.crl_cache)
        request = PushRequest(
            pinned_certificate=entry.pinned_certificate_der, trusted_cas=material.ca_certificates, also_trusted=also
        )

        outcome = await driver.push(target, request, material)

        assert outcome.certificate == device.installed_certificate()
        for part in DIRECTORIES:
            [item] = getattr(also, part)
            assert item in getattr(outcome.trust_list, part) and item in on_disk(device)[part], part
        assert as_sets(outcome.trust_list) == on_disk(device)
        pki_ca = material.ca_certificates[0].public_bytes(Encoding.DER)
        assert pki_ca in outcome.trust_list.trusted_certificates
        assert (device.store / "trusted" / "certs" / "scada-client.der").exists()

        # A push without it writes the PKI's list only: what the campaign added goes (certlm's own files).
        pinned = outcome.certificate.public_bytes(Encoding.DER)
        request = PushRequest(pinned_certificate=pinned, trusted_cas=material.ca_certificates)
        outcome = await driver.push(target, request, material)
        assert ca not in outcome.trust_list.trusted_certificates and ca not in on_disk(device)["trusted_certificates"]


async def test_a_push_refuses_an_also_trusted_that_is_no_trust_list(plant: SshPlant) -> None:
    device = await onboarded(plant)
    files = store_files(device)
    async with ssh_driver(plant, device) as (driver, target):
        runtime = plant.host.runtime
        entry = await find_entry_at("127.0.0.1", device.ssh_port, "ssh")
        assert entry is not None
        pki = await enrollment_pki(entry, runtime.pki_backends)
        material = await pki_material(pki, entry, runtime.pki_backends, runtime.services, runtime.crl_cache)
        request = PushRequest(
            pinned_certificate=entry.pinned_certificate_der,
            trusted_cas=material.ca_certificates,
            also_trusted=TrustList(trusted_crls=[b"not a CRL"]),
        )

        with pytest.raises(PushFailed) as failed:
            await driver.push(target, request, material)

    step = failed.value.steps[-1]
    assert (step.step, step.ok) == ("upload", False), failed.value.steps
    assert "the push's also_trusted is refused: trusted_crls[0] is no DER CRL" in failed.value.message
    assert failed.value.changed_device is False
    assert store_files(device) == files
