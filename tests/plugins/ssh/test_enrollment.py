"""Enrollment of an OPC UA server's certificate over SSH against the real test device: onboarding pins the host key
and identifies the device, the key is made on the device, files are swapped in with the previous ones kept, the server
is reloaded and presents the new certificate; renewal through ``POST /gds/push/change``."""

from __future__ import annotations

from urllib.parse import quote

from asyncua import ua
from certlm_ssh.opcua import presented_certificate
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from certlm.foundation.certs import to_der
from tests.plugins.ssh.conftest import SshPlant
from tests.plugins.ssh.device import secure_channel_state


async def test_onboarding_pins_the_host_key_identifies_the_device_and_installs_a_certificate(plant: SshPlant) -> None:
    [device] = plant.bed.devices
    factory = device.installed_certificate()
    before = await plant.register(device)
    assert before["host_key"] is None and before["has_password"] and plant.bed.password not in str(before)

    result = await plant.onboard(device)

    steps = [step["step"] for step in result["result"]["steps"]]
    assert steps[:6] == ["connect", "identify", "read_store", "csr", "enroll", "upload"]
    assert steps[-3:] == ["install", "reload", "verify"]
    settings = await plant.entry(device)
    assert settings["host_key"] == plant.bed.sshd.host_key()
    assert settings["host_key_fingerprint"].startswith("SHA256:")
    # Debian 12 on this machine: the example specific driver took the device over in the same session.
    assert settings["service"] == "ssh-debian-opcua-server"
    installed = device.installed_certificate()
    assert installed != factory and installed.subject == factory.subject
    uris = installed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert device.application_uri in uris.get_values_for_type(x509.UniformResourceIdentifier)
    assert await presented_certificate(device.opcua_url, 5) == installed
    # The key was made on the device (openssl), is the installed certificate's key and is private; the server uses it:
    # it opens a secure channel encrypted for the new certificate.
    [csr] = [step for step in result["result"]["steps"] if step["step"] == "csr"]
    assert csr["message"] == "key made on the device (openssl)", csr
    key = serialization.load_pem_private_key(device.key_path().read_bytes(), None)
    assert key.public_key() == installed.public_key()
    assert device.key_path().stat().st_mode & 0o777 == 0o600
    assert await secure_channel_state(device.opcua_url, installed) == ua.ServerState.Running
    assert (device.store / ".certlm-previous" / "own" / "certs" / device.cert_file).read_bytes() == to_der(factory)
    trusted = sorted(p.name for p in (device.store / "trusted" / "certs").iterdir())
    assert "scada-client.der" in trusted and any(name.startswith("certlm-") for name in trusted)
    assert any(p.name.startswith("certlm-") for p in (device.store / "trusted" / "crl").iterdir())

    listed = await plant.inventory_entry(device)
    assert listed["service"] == "ssh-debian-opcua-server"
    assert listed["url"] == f"ssh://127.0.0.1:{device.ssh_port}"
    assert listed["cert_base64"] is not None and listed["username"] == plant.bed.user


async def test_renewal_through_push_change_installs_a_new_certificate(plant: SshPlant) -> None:
    [device] = plant.bed.devices
    await plant.register(device, password=False)  # the private key this time
    await plant.onboard(device)
    first = device.installed_certificate()

    status, body = await plant.call("POST", "/gds/push/change", {"server": "127.0.0.1", "port": device.ssh_port})

    assert status == 200, body
    renewed = device.installed_certificate()
    assert renewed != first and await presented_certificate(device.opcua_url, 5) == renewed
    assert await secure_channel_state(device.opcua_url, renewed) == ua.ServerState.Running
    status, last = await plant.call("GET", f"/gds/push/{quote(f'ssh://127.0.0.1:{device.ssh_port}', safe='')}")
    assert status == 200 and last["result"]["trigger"] == "POST /gds/push/change"


async def test_the_ssh_drivers_are_supported_devices(plant: SshPlant) -> None:
    status, rows = await plant.call("GET", "/supported-devices")
    assert status == 200
    assert {"vendor": "debian", "device_name": "Debian GNU/Linux", "service": "ssh-debian-opcua-server"}.items() <= {
        key: value for row in rows if row["service"] == "ssh-debian-opcua-server" for key, value in row.items()
    }.items()
