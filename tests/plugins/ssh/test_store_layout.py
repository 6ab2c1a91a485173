"""What a push does to the store as the device had it, against the real test device: the first contact says which
driver and layout identification chose and why, and a store read that finds nothing names the paths it read; the
trust directories keep the modes and owners they had, and what certlm makes is readable by the server (a server
running as another user than certlm's login still reads its store)."""

from __future__ import annotations

import grp
import pwd
import shutil
import stat

from asyncua import ua

from tests.plugins.ssh.conftest import SshPlant, failed_step
from tests.plugins.ssh.device import running_as_root, secure_channel_state

FILE_NAMES = ("certificate_file", "certificate_format", "private_key_file", "private_key_format")


async def test_first_contact_says_which_driver_and_layout_it_chose_and_which_paths_it_read(plant: SshPlant) -> None:
    [device] = plant.bed.devices
    # The device keeps its certificate where ssh-generic looks (own/certs/cert.der); the entry names no file of its own.
    layout = {name: value for name, value in device.layout().items() if name not in FILE_NAMES}
    registered = await plant.register(device, layout=layout)
    assert registered["service"] == "ssh-generic" and registered["layout"]["certificate_file"] == "cert.der"

    result = await plant.push(device, onboarding=True)

    assert not result["success"]
    [identified] = [step for step in result["result"]["steps"] if step["step"] == "identify"]
    said = identified["message"]
    assert "the device says debian / Debian GNU/Linux /" in said, said
    assert "ssh-debian-opcua-server supports it (firmware 12, 13), instead of ssh-generic" in said, said
    assert "certificate own/certs/server_cert.pem (PEM), key own/private/server_key.pem (PEM)" in said, said
    assert f"store {device.store}" in said and "the entry overrides" in said, said
    [read] = [step for step in result["result"]["steps"] if step["step"] == "read_store"]
    assert read["message"] == f"{device.store}/own/certs/server_cert.pem: no certificate there", read
    step = failed_step(result)
    assert (step["step"], step["status"]) == ("csr", "NoApplicationUri"), step
    assert f"there is no certificate at {device.store}/own/certs/server_cert.pem" in result["error"], result
    assert "the directory holds cert.der" in result["error"] and "layout.certificate_file" in result["error"]
    assert result["result"]["device_changed"] is False
    assert (await plant.entry(device))["service"] == "ssh-debian-opcua-server"

    # The operator points the entry at the files the server uses: the onboarding goes through.
    status, body = await plant.call("POST", "/ssh/device", {"server": "127.0.0.1", "port": device.ssh_port,
                                                             "layout": device.layout()})  # fmt: skip
    assert status == 200 and body["layout"]["certificate_file"] == "cert.der", body
    onboarded = await plant.onboard(device)
    [read] = [step for step in onboarded["result"]["steps"] if step["step"] == "read_store"]
    assert read["message"].startswith(f"{device.store}/own/certs/cert.der: serial "), read
    assert await secure_channel_state(device.opcua_url, device.installed_certificate()) == ua.ServerState.Running


async def test_the_trust_directories_keep_their_modes_and_owners(plant: SshPlant) -> None:
    [device] = plant.bed.devices
    # As on a gateway whose OPC UA server runs as another user than certlm's login: the directories are that user's,
    # readable by others (one by its group only); certlm logs in as root where the tests can make it.
    modes = {"trusted": 0o755, "trusted/certs": 0o755, "trusted/crl": 0o750, "issuer": 0o755, "issuer/certs": 0o711}
    for directory, mode in modes.items():
        (device.store / directory).chmod(mode)
    # Directories the store lacks are made, readable by the server: the key's readable by its group, as its key is.
    (device.store / "issuer" / "crl").rmdir()
    shutil.rmtree(device.store / "own" / "private")
    store = device.store.stat()
    server_user = f"{pwd.getpwuid(store.st_uid).pw_name}:{grp.getgrgid(store.st_gid).gr_name}"
    owners = {directory: (device.store / directory).stat().st_uid for directory in modes}
    login = {"username": "root"} if running_as_root() else {}

    await plant.register(
        device, password=False, layout={**device.layout(), "key_owner": server_user, "key_mode": "0640"}, **login
    )
    await plant.onboard(device)
    assert (await plant.push(device))["success"]  # a renewal, after which the previous generation is certlm's own

    for directory, mode in modes.items():
        found = (device.store / directory).stat()
        assert (stat.S_IMODE(found.st_mode), found.st_uid) == (mode, owners[directory]), directory
    assert stat.S_IMODE((device.store / "issuer" / "crl").stat().st_mode) == 0o755
    written = [path for path in (device.store / "trusted").rglob("certlm-*")]
    assert written and all(stat.S_IMODE(path.stat().st_mode) == 0o644 for path in written)
    if running_as_root():  # certlm's files are its login's, the directories still the server user's
        assert {path.stat().st_uid for path in written} == {0} and set(owners.values()) == {device.store.stat().st_uid}
        assert device.store.stat().st_uid != 0
    assert (device.store / "trusted" / "certs" / "scada-client.der").exists()
    key_directory, key = (device.store / "own" / "private").stat(), device.key_path().stat()
    assert (stat.S_IMODE(key_directory.st_mode), key_directory.st_uid, key_directory.st_gid) == (
        0o750, store.st_uid, store.st_gid
    )
    assert (stat.S_IMODE(key.st_mode), key.st_uid, key.st_gid) == (0o640, store.st_uid, store.st_gid)
    assert stat.S_IMODE((device.store / ".certlm-previous").stat().st_mode) == 0o700
