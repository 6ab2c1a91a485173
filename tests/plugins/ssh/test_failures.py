"""What goes wrong on a real SSH device, and what certlm leaves behind: a reload that fails or a server that does not
come back with the new certificate (rolled back to the previous files), a wrong password, a changed host key, the
device going down in the middle of the upload, an automated push to a device whose host key nobody pinned."""

from __future__ import annotations

import asyncio
import re
import time

import pytest
from certlm_ssh.connection import host_key_fingerprint
from certlm_ssh.opcua import presented_certificate
from cryptography import x509

from tests.plugins.ssh.conftest import QUICK_VERIFY_WAIT_S, SshPlant, failed_step, store_files
from tests.plugins.ssh.device import StoreDevice, running_as_root
from tests.support import eventually


async def onboarded(plant: SshPlant, **settings) -> StoreDevice:
    [device] = plant.bed.devices
    await plant.register(device, **settings)
    await plant.onboard(device)
    return device


def kept_certificate(device: StoreDevice) -> x509.Certificate:
    """The certificate of the generation the store keeps in ``.certlm-previous``."""
    kept = device.store / ".certlm-previous" / "own" / "certs" / device.cert_file
    return x509.load_der_x509_certificate(kept.read_bytes())


async def test_a_reload_that_fails_is_rolled_back_to_the_previous_files(plant: SshPlant) -> None:
    device = await onboarded(plant)
    before, installed = store_files(device), device.installed_certificate()
    (device.directory / "reject-next").touch()

    result = await plant.push(device)

    assert not result["success"]
    assert failed_step(result)["step"] == "reload" and failed_step(result)["status"] == "CommandFailed"
    rollback = result["result"]["steps"][-1]
    assert rollback["step"] == "rollback" and rollback["ok"], rollback
    assert result["result"]["device_changed"] is False
    assert store_files(device) == before
    assert await presented_certificate(device.opcua_url, 5) == installed
    # The last good generation is still kept, for the next rollback.
    assert kept_certificate(device) == installed


async def test_a_rollback_whose_reload_keeps_failing_reports_the_device_unchanged(plant: SshPlant) -> None:
    device = await onboarded(plant)
    before, installed = store_files(device), device.installed_certificate()
    # Every reload fails: the server is never restarted and keeps running on the files it started with.
    (device.directory / "reject-all").touch()

    result = await plant.push(device)

    assert failed_step(result)["step"] == "reload"
    rollback = result["result"]["steps"][-1]
    assert rollback["step"] == "rollback" and rollback["ok"], rollback
    assert "the reload after the restore failed" in rollback["message"], rollback
    assert "the server presents the previous certificate" in rollback["message"], rollback
    assert result["result"]["device_changed"] is False
    assert store_files(device) == before
    assert await presented_certificate(device.opcua_url, 5) == installed
    assert kept_certificate(device) == installed


async def test_a_store_directory_the_login_cannot_write_stops_the_install_before_it_changes_anything(
    plant: SshPlant,
) -> None:
    device = await onboarded(plant)
    before, installed = store_files(device), device.installed_certificate()
    crl_directory = device.store / "trusted" / "crl"
    crl_directory.chmod(0o555)
    try:
        result = await plant.push(device)
    finally:
        crl_directory.chmod(0o755)

    step = failed_step(result)
    assert (step["step"], step["status"]) == ("install", "CommandFailed"), step
    assert "the install script exited with 1: trusted/crl is not writable by the SSH user" in result["error"], result
    rollback = result["result"]["steps"][-1]
    assert rollback["step"] == "rollback" and rollback["ok"] and "nothing to restore" in rollback["message"], rollback
    assert result["result"]["device_changed"] is False
    assert store_files(device) == before
    assert await presented_certificate(device.opcua_url, 5) == installed


async def test_a_server_that_does_not_present_the_new_certificate_is_rolled_back(plant: SshPlant) -> None:
    device = await onboarded(plant)
    before, installed = store_files(device), device.installed_certificate()
    # A reload command that succeeds without restarting anything: the server keeps presenting the old certificate.
    layout = {**device.layout(), "reload_command": "true", "reload_timeout_s": 2.0}
    status, body = await plant.call("POST", "/ssh/device", {"server": "127.0.0.1", "port": device.ssh_port,
                                                             "layout": layout})  # fmt: skip
    assert status == 200, body

    result = await plant.push(device)

    assert failed_step(result)["step"] == "verify" and "did not present the new certificate" in result["error"]
    assert result["result"]["steps"][-1]["step"] == "rollback" and result["result"]["steps"][-1]["ok"]
    assert store_files(device) == before
    assert await presented_certificate(device.opcua_url, 5) == installed


async def test_the_verify_wait_is_bounded_by_its_own_setting_and_reported(quick_verify_plant: SshPlant) -> None:
    plant = quick_verify_plant
    [device] = plant.bed.devices
    # Onboarded with a wait of the entry's own: a loaded machine may take longer than the quick wait to restart the
    # server, and the onboarding is not what this test measures.
    await plant.register(device, layout={**device.layout(), "reload_timeout_s": 60})
    onboarded = await plant.onboard(device)
    [verified] = [step for step in onboarded["result"]["steps"] if step["step"] == "verify"]
    assert re.fullmatch(r".* presents the new certificate \(after \d+\.\d s\)", verified["message"]), verified
    installed = device.installed_certificate()
    # A reload that restarts nothing: the server keeps presenting the old certificate. No reload_timeout_s of the
    # entry's own any more: the plugin's verify wait applies.
    layout = {"reload_command": "true", "reload_timeout_s": None}
    status, body = await plant.call(
        "POST", "/ssh/device", {"server": "127.0.0.1", "port": device.ssh_port, "layout": layout}
    )
    assert status == 200 and body["layout"]["reload_timeout_s"] is None, body

    started = time.monotonic()
    result = await plant.push(device)
    took = time.monotonic() - started

    step = failed_step(result)
    assert step["step"] == "verify", step
    # The verify wait, the rollback (the old certificate is there at once) and the SSH sessions: well under the 15 s
    # the device operation time-out is here, let alone the layout's former 30 s.
    assert QUICK_VERIFY_WAIT_S <= took < QUICK_VERIFY_WAIT_S + 8, took
    waited = re.search(r"within the verify wait of (\d+) s \(waited (\d+\.\d) s\)", result["error"])
    assert waited and float(waited[1]) == QUICK_VERIFY_WAIT_S, result["error"]
    assert QUICK_VERIFY_WAIT_S <= float(waited[2]) < QUICK_VERIFY_WAIT_S + 5
    rollback = result["result"]["steps"][-1]
    assert rollback["step"] == "rollback" and rollback["ok"] and result["result"]["device_changed"] is False
    assert await presented_certificate(device.opcua_url, 5) == installed


@pytest.mark.skipif(not running_as_root(), reason="password logins need the test user, made as root")
async def test_a_wrong_password_is_refused_at_connect_and_changes_nothing(plant: SshPlant) -> None:
    device = await onboarded(plant)
    before = store_files(device)
    status, body = await plant.call(
        "POST", "/ssh/device", {"server": "127.0.0.1", "port": device.ssh_port, "password": "not-the-password"}
    )
    assert status == 200, body

    result = await plant.push(device)

    step = failed_step(result)
    assert (step["step"], step["status"]) == ("connect", "PermissionDenied")
    assert result["result"]["device_changed"] is False and store_files(device) == before


async def test_a_changed_host_key_is_refused_until_an_operator_pins_it_again(plant: SshPlant) -> None:
    device = await onboarded(plant)
    pinned = (await plant.entry(device))["host_key"]
    before = store_files(device)
    sshd = plant.bed.sshd
    await asyncio.to_thread(sshd.stop)
    sshd.new_host_key()
    await asyncio.to_thread(sshd.start)

    result = await plant.push(device)

    step = failed_step(result)
    assert (step["step"], step["status"]) == ("connect", "HostKeyMismatch")
    # Both keys named, as the operator compares them with the device's console.
    presented = sshd.host_key_fingerprint()
    assert f"pinned ssh-ed25519 {host_key_fingerprint(pinned)}" in result["error"], result["error"]
    assert f"presented ssh-ed25519 {presented}" in result["error"], result["error"]
    # The push marked the entry as the monitor would.
    reason = (await plant.inventory_entry(device))["schedule"]["identity_changed_reason"]
    assert reason and reason in result["error"]
    assert store_files(device) == before
    # Onboarding again does not replace a pinned key either: only the operator's explicit pin does.
    assert failed_step(await plant.push(device, onboarding=True))["status"] == "HostKeyMismatch"
    address = {"server": "127.0.0.1", "port": device.ssh_port}
    status, body = await plant.call("POST", "/ssh/hostkey", address)
    assert status == 409 and "replace true" in body["error"]
    status, body = await plant.call("POST", "/ssh/hostkey", {**address, "fingerprint": "SHA256:" + "A" * 43})
    assert status == 409 and "nothing was pinned" in body["error"]
    status, body = await plant.call("POST", "/ssh/hostkey", {**address, "replace": True})
    assert status == 200 and body["host_key"] == sshd.host_key() != pinned
    assert (await plant.inventory_entry(device))["schedule"]["identity_changed_at"] is None
    assert (await plant.push(device))["success"]


# Generous time-outs: on a loaded machine an SSH handshake can take over the usual 3 s, and this test is about the
# device going away mid-upload (a lost connection, noticed at once), not about slow devices.
@pytest.mark.parametrize("certlm_settings", [{"device_connect_timeout_s": 15.0, "device_operation_timeout_s": 30.0}])
async def test_the_device_going_down_during_the_upload_leaves_its_store_as_it_was(plant: SshPlant) -> None:
    device = await onboarded(plant)
    before, installed = store_files(device), device.installed_certificate()
    base = plant.bed.base
    # The push's second SFTP session (the first reads the store) waits in the device while this exists.
    (base / "hold-sftp").write_text("2")

    push = asyncio.create_task(plant.push(device))

    async def upload_started_or_push_ended() -> bool:
        return (base / "sftp-started").exists() or push.done()

    await eventually(upload_started_or_push_ended, "the upload to start", timeout=60)
    assert not push.done(), f"the push ended before its upload started: {push.result()}"
    await asyncio.to_thread(plant.bed.sshd.stop)
    (base / "hold-sftp").unlink()
    result = await asyncio.wait_for(push, 60)

    step = failed_step(result)
    assert step["step"] == "upload" and step["status"] in ("ConnectionLost", "CommandFailed"), step
    assert result["result"]["device_changed"] is False
    assert store_files(device) == before
    assert await presented_certificate(device.opcua_url, 5) == installed


async def test_an_automated_push_never_pins_a_host_key(plant: SshPlant) -> None:
    [device] = plant.bed.devices
    await plant.register(device)

    result = await plant.push(device, automated=True)

    assert not result["success"] and "no pinned" in result["error"]
    assert (await plant.entry(device))["host_key"] is None
