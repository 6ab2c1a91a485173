"""The host's push, monitor and inventory routes reach an SSH entry (the host routes an address to an entry of any
device table): ``POST /gds/push/onboarding`` and ``/gds/push/change``, ``GET /gds/push/{host_or_url}``,
``/gds/monitor/crt/{host_or_url}``, ``/gds/monitor/trustlist/{host_or_url}`` and ``/gds/inventory/crt/{host_or_url}``,
checked against the store on the test device's disk and the certificate its OPC UA server presents."""

from __future__ import annotations

from urllib.parse import quote

from certlm_ssh.opcua import presented_certificate
from cryptography import x509

from certlm.foundation.certs import serial_hex, sha1_fingerprint
from tests.plugins.ssh.conftest import SshPlant


async def test_the_host_push_monitor_and_inventory_routes_reach_an_ssh_entry(plant: SshPlant) -> None:
    [device] = plant.bed.devices
    factory = device.installed_certificate()
    await plant.register(device)  # POST /inventory {table: ssh} and POST /ssh/device: the login and the layout
    address = {"server": "127.0.0.1", "port": device.ssh_port}
    host = f"127.0.0.1:{device.ssh_port}"
    url = f"ssh://{host}"

    status, outcome = await plant.call("POST", "/gds/push/onboarding", {**address, "debug": True})
    assert status == 200 and outcome["success"], outcome
    steps = [step["step"] for step in outcome["result"]["steps"]]
    assert steps[:2] == ["connect", "identify"] and steps[-3:] == ["install", "reload", "verify"], steps
    onboarded = device.installed_certificate()
    assert onboarded != factory
    status, last = await plant.call("GET", f"/gds/push/onboarding/{host}")
    assert status == 200 and last["result"]["trigger"] == "POST /gds/push/onboarding", last

    status, outcome = await plant.call("POST", "/gds/push/change", address)
    assert status == 200 and outcome["success"], outcome
    installed = device.installed_certificate()  # read from the store on the device's disk
    assert installed != onboarded and await presented_certificate(device.opcua_url, 5) == installed

    # The last push, by host:port and by the entry's URL, with its steps.
    for name in (host, quote(url, safe="")):
        status, last = await plant.call("GET", f"/gds/push/{name}")
        assert status == 200 and last["success"], last
        assert last["result"]["trigger"] == "POST /gds/push/change", last
        recorded = [step["step"] for step in last["result"]["steps"]]
        assert recorded[0] == "connect" and recorded[-3:] == ["install", "reload", "verify"], recorded
        assert "identify" not in recorded  # a renewal of an identified device

    # The live read: the certificate the OPC UA endpoint presents, the one on disk.
    status, read = await plant.call("GET", f"/gds/monitor/crt/{host}?fingerprint=sha1")
    assert status == 200, read
    assert read["url"] == url and read["fingerprint"] == sha1_fingerprint(installed), read

    status, trust = await plant.call("GET", f"/gds/monitor/trustlist/{host}")
    assert status == 200 and trust["url"] == url, trust
    assert len(trust["trustlist_trusted_ca"]) == 2, trust  # certlm's CA and the operator's own client
    assert len(trust["trustlist_trusted_crl"]) == 1, trust

    # The stored certificate detail: the installed serial.
    status, detail = await plant.call("GET", f"/gds/inventory/crt/{host}")
    assert status == 200 and detail["url"] == url, detail
    assert detail["certificate"]["serial_number"] == serial_hex(installed), detail
    assert detail["certificate"]["sha1_thumbprint"] == sha1_fingerprint(installed)
    uris = installed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert device.application_uri in uris.get_values_for_type(x509.UniformResourceIdentifier)
