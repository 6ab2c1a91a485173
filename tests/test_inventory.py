"""``certlm.inventory.entries`` called directly, as the schedulers and the monitor call it: how a host is spelled and
found, registering an entry again, what a driver gets to reach a device, and forgetting stored trust lists. The REST
views of entries are tested through the API (``blueprints/test_inventory.py``); entry URLs and services in
``test_entry_urls.py``."""

from __future__ import annotations

import base64

import pytest

from certlm.contracts.drivers import TrustList
from certlm.foundation.certs import to_der
from certlm.foundation.errors import APIError, NotFound
from certlm.foundation.hostspec import HostSpec
from certlm.inventory.entries import (
    TRUST_LIST_FIELDS,
    canonical_server,
    checked_server,
    device_entry_at,
    find_entry,
    find_entry_at,
    forget_stored_trust_lists,
    licensed_endpoints_in_use,
    trust_list_fields,
    verified_pkcs12,
)
from certlm.storage.migrations import DEVICE_STATUS_DELETED
from certlm.storage.models import DeviceCredential, InventoryEntry
from tests.crypto_factory import pkcs12_base64, self_signed
from tests.support import InProcessApp

P12_PASSWORD = "p12-Pa55"


@pytest.mark.parametrize(
    ("written", "stored"),
    [
        ("PLC-7.Plant.Local", "plc-7.plant.local"),
        (" plc-7 ", "plc-7"),
        ("[2001:DB8:0:0::7]", "2001:db8::7"),
        ("2001:0db8::0007", "2001:db8::7"),
        ("192.0.2.7", "192.0.2.7"),
    ],
)
def test_a_host_is_stored_in_one_spelling(written: str, stored: str) -> None:
    assert canonical_server(written) == checked_server(written) == stored


@pytest.mark.parametrize("written", ["plc 7", "dead:beef:zz::1", "", "plc_7/line"])
def test_what_is_no_host_name_or_address_is_refused(written: str) -> None:
    with pytest.raises(ValueError, match="must be a hostname, an IPv4 address or an IPv6 address"):
        checked_server(written)


async def test_a_vendor_tables_entries_are_found_and_counted_against_the_license(in_process: InProcessApp) -> None:
    """The device tables are the plugins': an entry of a table the host never heard of (``acme``) is found by
    address, preferred after ``gds`` at the same address, and counts as a licensed endpoint until marked deleted."""
    inventory = in_process.host.inventory
    async with in_process.context():
        before = await licensed_endpoints_in_use()
        press = await inventory.create_entry("acme", "press-4.plant.local", 502, {})
        assert await licensed_endpoints_in_use() == before + 1
        assert (await find_entry(HostSpec("press-4.plant.local", None))).id == press.id
        assert (await device_entry_at("press-4.plant.local", 502)).id == press.id
        gds = await inventory.create_entry("gds", "press-4.plant.local", 502, {})
        assert (await device_entry_at("press-4.plant.local", 502)).id == gds.id
        assert (await find_entry(HostSpec("press-4.plant.local", 502), ("acme",))).id == press.id
        await inventory.update_entry(press, {"device_status": DEVICE_STATUS_DELETED})
        assert await licensed_endpoints_in_use() == before + 1  # the gds entry


async def test_an_entry_is_found_by_host_and_by_host_and_port(in_process: InProcessApp) -> None:
    inventory = in_process.host.inventory
    async with in_process.context():
        first = await inventory.create_entry("gds", "plc-7.plant.local", 4840, {})
        await inventory.create_entry("opc", "gateway-3.plant.local", 4841, {})

        assert (await find_entry(HostSpec("PLC-7.plant.local", None))).id == first.id
        assert (await find_entry(HostSpec("plc-7.plant.local", 4840))).id == first.id
        # Only the tables asked: the OPC entry is no GDS entry.
        with pytest.raises(NotFound, match=r"no inventory entry for gateway-3\.plant\.local:4841"):
            await find_entry(HostSpec("gateway-3.plant.local", 4841), ("gds",))

        second = await inventory.create_entry("gds", "plc-7.plant.local", 4842, {})
        with pytest.raises(APIError) as ambiguous:
            await find_entry(HostSpec("plc-7.plant.local", None))
        assert ambiguous.value.status == 400
        assert ambiguous.value.message == "plc-7.plant.local has entries on several ports (4840, 4842): give host:port"
        assert (await find_entry(HostSpec("plc-7.plant.local", 4842))).id == second.id


async def test_creating_a_known_entry_again_is_a_conflict(in_process: InProcessApp) -> None:
    inventory = in_process.host.inventory
    async with in_process.context():
        await inventory.create_entry("gds", "plc-8.plant.local", 4840, {"name": "Press 8"})
        with pytest.raises(APIError) as duplicate:
            await inventory.create_entry("gds", "plc-8.plant.local", 4840, {})
        assert duplicate.value.status == 409


async def test_a_driver_gets_the_stored_credentials_decrypted_and_the_pinned_certificate(
    in_process: InProcessApp,
) -> None:
    inventory = in_process.host.inventory
    upload = pkcs12_base64(P12_PASSWORD, common_name="maintenance")
    pinned, _ = self_signed(common_name="plc-9")
    async with in_process.context():
        entry = await inventory.create_entry(
            "gds", "plc-9.plant.local", 4843, {"security_policy": 4, "security_mode": 4}
        )
        entry.pinned_certificate_der = to_der(pinned)
        await entry.save()
        pkcs12 = verified_pkcs12(upload, P12_PASSWORD, "userinfo_pkcs12_base64")
        await inventory.save_credentials(
            entry, username="admin", password="Dev1ce-pw", pkcs12=pkcs12, pkcs12_password=P12_PASSWORD
        )

        target = await inventory.device_target(entry)
        stored = await DeviceCredential.get(entry_id=entry.id)

    assert (target.entry_id, target.server, target.port) == (entry.id, "plc-9.plant.local", 4843)
    assert target.url == "opc.tcp://plc-9.plant.local:4843"
    assert (target.security_policy, target.security_mode) == (4, 4)
    assert (target.username, target.password) == ("admin", "Dev1ce-pw")
    assert target.pkcs12 == base64.b64decode(upload) and target.pkcs12_password == P12_PASSWORD
    assert target.pinned_certificate == entry.pinned_certificate_der
    # At rest, only the username is in the clear.
    assert "Dev1ce-pw" not in stored.password_enc and P12_PASSWORD not in stored.pkcs12_password_enc


async def test_a_new_pkcs12_without_a_password_clears_the_old_password(in_process: InProcessApp) -> None:
    inventory = in_process.host.inventory
    async with in_process.context():
        entry = await inventory.create_entry("gds", "plc-10.plant.local", 4840, {})
        first = verified_pkcs12(pkcs12_base64(P12_PASSWORD), P12_PASSWORD, "userinfo_pkcs12_base64")
        await inventory.save_credentials(entry, username="admin", pkcs12=first, pkcs12_password=P12_PASSWORD)
        second = verified_pkcs12(pkcs12_base64(None), None, "userinfo_pkcs12_base64")
        await inventory.save_credentials(entry, pkcs12=second)
        target = await inventory.device_target(entry)
    assert target.username == "admin", "parts not given stay as they were"
    assert target.pkcs12 == second and target.pkcs12_password is None


def test_a_pkcs12_upload_is_kept_only_when_its_password_opens_it() -> None:
    with pytest.raises(APIError, match="userinfo_pkcs12_base64 is not a PKCS#12 file or cannot be decrypted"):
        verified_pkcs12(pkcs12_base64(P12_PASSWORD), "wrong", "userinfo_pkcs12_base64")


def test_trust_list_fields_follow_the_trust_list_mask_bits() -> None:
    assert trust_list_fields(TrustList.ALL) == list(TRUST_LIST_FIELDS)
    assert trust_list_fields(TrustList.MASK_BITS["trusted_crls"] | TrustList.MASK_BITS["issuer_crls"]) == [
        "trustlist_trusted_crl",
        "trustlist_issuer_crl",
    ]
    assert trust_list_fields(0) == []


async def test_forgetting_stored_trust_lists_touches_only_the_parts_masked_of_gds_entries(
    in_process: InProcessApp,
) -> None:
    inventory = in_process.host.inventory
    full = {key: ["MIIB"] for key in TRUST_LIST_FIELDS}
    crls_only = {"trustlist_trusted_crl": ["MIIC"], "trustlist_issuer_crl": ["MIID"]}
    crls = TrustList.MASK_BITS["trusted_crls"] | TrustList.MASK_BITS["issuer_crls"]
    async with in_process.context():
        with_all = await inventory.create_entry("gds", "plc-11.plant.local", 4840, {"trustlist": full})
        with_crls = await inventory.create_entry("gds", "plc-12.plant.local", 4840, {"trustlist": crls_only})
        without = await inventory.create_entry("gds", "plc-13.plant.local", 4840, {})
        other_table = await inventory.create_entry("opc", "plc-14.plant.local", 4840, {"trustlist": full})

        assert await forget_stored_trust_lists(crls) == 2

        stored = {entry.id: entry.trustlist for entry in await InventoryEntry.all()}
    assert stored[with_all.id] == {"trustlist_trusted_ca": ["MIIB"], "trustlist_issuer_ca": ["MIIB"]}
    assert stored[with_crls.id] is None, "nothing left of it"
    assert stored[without.id] is None
    assert stored[other_table.id] == full


async def test_lookups_by_address_use_the_lower_case_server_key_in_any_spelling(in_process: InProcessApp) -> None:
    inventory = in_process.host.inventory
    async with in_process.context():
        # Stored as a caller spelled it (the sample database and older versions did so).
        entry = await InventoryEntry.create(protocol="gds", service="gds-unmanaged", server="PLC-30.Plant.Local")
        assert entry.server_key == "plc-30.plant.local"
        assert (await find_entry_at("plc-30.PLANT.local", 4840, "gds")).id == entry.id
        assert (await find_entry(HostSpec("Plc-30.Plant.Local", None))).id == entry.id
        with pytest.raises(APIError) as duplicate:
            await inventory.create_entry("gds", "plc-30.plant.local", 4840, {})
        assert duplicate.value.status == 409

        # A renamed entry is found under its new name only.
        entry.server = "PLC-31.Plant.Local"
        await entry.save(update_fields=["server"])
        assert (await InventoryEntry.get(id=entry.id)).server_key == "plc-31.plant.local"
        assert await find_entry_at("plc-30.plant.local", 4840, "gds") is None
        assert (await find_entry_at("plc-31.plant.local", 4840, "gds")).id == entry.id
