"""Rows read once per request or push (``certlm.storage.reads``): once within a scope, at every call outside one,
again after the code that changed them forgot them; and never longer than the request, so that what another instance
on the database changed (a license, a CA's row) is seen by the next request."""

from __future__ import annotations

from tortoise import connections

from certlm import forget_read, read_once
from certlm.storage.reads import reads_once
from certlm.testing import InProcessApp, InternalCa


class Loads:
    def __init__(self) -> None:
        self.count = 0

    async def __call__(self) -> int:
        self.count += 1
        return self.count


async def test_a_row_is_read_once_in_a_scope_and_at_every_call_outside_one() -> None:
    load = Loads()
    assert [await read_once("row", load), await read_once("row", load)] == [1, 2]
    with reads_once():
        assert [await read_once("row", load), await read_once("row", load)] == [3, 3]
        with reads_once():  # a scope within a scope is the same scope
            assert await read_once("row", load) == 3
        forget_read("row")
        assert await read_once("row", load) == 4
    assert await read_once("row", load) == 5


async def test_a_license_another_instance_removed_is_no_longer_in_force_at_the_next_request(
    certlm_in_process: InProcessApp,
) -> None:
    status, _ = await certlm_in_process.call("GET", "/gds/inventory")
    assert status == 200
    async with certlm_in_process.context():
        # What another instance on the same database does when an operator removes the license there.
        await connections.get("default").execute_query("DELETE FROM license")

    status, body = await certlm_in_process.call("GET", "/gds/inventory")

    assert status == 403 and "no license installed" in body["error"], body


async def test_a_crl_another_instance_signed_is_served_at_the_next_request(
    certlm_in_process: InProcessApp, certlm_internal_ca: InternalCa
) -> None:
    path = f"/pki/crl/{certlm_internal_ca.pki_id}?format=der"
    first = await certlm_in_process.client.get(path, headers=certlm_in_process.headers)
    assert first.status_code == 200
    async with certlm_in_process.context():
        # Another instance re-signed the CA's CRL: the row holds a newer one (here: the CRL made stale, so that this
        # instance signs the next one itself, with the next number).
        await connections.get("default").execute_query("UPDATE pki_internal_ca SET crl_last_update = NULL")

    second = await certlm_in_process.client.get(path, headers=certlm_in_process.headers)

    assert second.status_code == 200 and await second.get_data() != await first.get_data()
