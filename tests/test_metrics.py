"""``GET /metrics`` over an inventory larger than one read batch: every active device shows once, with its own
figures, and the inactive ones not at all."""

from __future__ import annotations

from datetime import UTC, datetime

from cryptography.hazmat.primitives import serialization
from prometheus_client.parser import text_string_to_metric_families

from certlm.inventory.entries import LISTING_BATCH
from certlm.storage.models import DeviceSchedule, InventoryEntry
from tests.crypto_factory import ec_key, make_ca
from tests.support import LicenseKeys, in_process_settings, licensed_app_in_process


async def test_metrics_show_each_active_device_of_a_large_inventory_once(tmp_path, license_keys: LicenseKeys) -> None:
    ca = make_ca("Metrics CA")
    certificate = ca.issue("CN=plc", ec_key().public_key())
    der = certificate.public_bytes(serialization.Encoding.DER)
    devices = 2 * LISTING_BATCH + 7
    settings = in_process_settings(tmp_path, license_keys)
    async with licensed_app_in_process(settings, license_keys) as (client, headers, _):
        await InventoryEntry.bulk_create(
            [
                InventoryEntry(
                    protocol="gds",
                    service="gds-push-generic",
                    server=f"plc-{index}",
                    server_key=f"plc-{index}",
                    port=4840,
                    name=f"PLC {index}",
                    # Every third entry inactive, every other one with a certificate and its own renewal_days.
                    device_status=0 if index % 3 == 0 else 1,
                    certificate_der=der if index % 2 == 0 else None,
                    renewal_days=index % 50,
                )
                for index in range(devices)
            ]
        )
        entries = {entry.server: entry for entry in await InventoryEntry.all()}
        unreachable = [f"plc-{index}" for index in range(devices) if index % 5 == 0]
        await DeviceSchedule.bulk_create(
            [DeviceSchedule(entry=entries[server], unreachable_since=datetime.now(UTC)) for server in unreachable]
        )
        response = await client.get("/metrics", headers=headers)
        assert response.status_code == 200
        families = {
            family.name: family for family in text_string_to_metric_families(await response.get_data(as_text=True))
        }

    def by_server(name: str) -> dict[str, float]:
        samples = families[name].samples
        servers = [sample.labels["device"].split("//")[1].split(":")[0] for sample in samples]
        assert len(servers) == len(set(servers)), f"{name}: a device shown twice"
        return dict(zip(servers, (sample.value for sample in samples), strict=True))

    active = {f"plc-{index}" for index in range(devices) if index % 3 != 0}
    with_certificate = {f"plc-{index}" for index in range(devices) if index % 3 != 0 and index % 2 == 0}
    assert by_server("certlm_certificate_not_after_timestamp_seconds") == dict.fromkeys(
        with_certificate, certificate.not_valid_after_utc.timestamp()
    )
    assert by_server("certlm_certificate_renewal_days") == {
        server: int(server.split("-")[1]) % 50 for server in with_certificate
    }
    active_unreachable = active & set(unreachable)
    assert by_server("certlm_device_unreachable") == dict.fromkeys(active_unreachable, 1)
    assert families["certlm_devices_unreachable"].samples[0].value == len(active_unreachable)
