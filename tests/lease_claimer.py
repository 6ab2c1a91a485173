"""A certlm instance's lease claims, as a process of its own: ``python -m tests.lease_claimer DATABASE_URL STEP N``.

Opens the database as ``certlm serve`` does. ``setup`` creates the schema and ``N`` inventory entries and prints their
ids as one JSON list. ``race`` reads the entries, prints ``READY`` and waits for a line on stdin (the test's barrier:
it sends one to every racer once all are ready), then tries to claim the lease of each entry once, all at the same
time, and prints the ids it won as one JSON list. Several of these started together race for the same rows.
"""

from __future__ import annotations

import asyncio
import json
import sys

from certlm.lifecycle.leases import ensure_rows, try_claim
from certlm.storage import close_storage, open_storage
from certlm.storage.models import InventoryEntry


async def main(database_url: str, step: str, count: int) -> None:
    await open_storage(database_url, [])
    try:
        if step == "setup":
            entries = [
                await InventoryEntry.create(protocol="gds", service="gds-push-generic", server=f"plc-{n}", port=4840)
                for n in range(count)
            ]
            await ensure_rows([entry.id for entry in entries])
            print(json.dumps([entry.id for entry in entries]))
            return
        ids = [entry.id for entry in await InventoryEntry.all().order_by("id")]
        print("READY", flush=True)
        await asyncio.to_thread(sys.stdin.readline)
        claims = await asyncio.gather(*(try_claim(entry_id) for entry_id in ids))
        print(json.dumps([claim.entry_id for claim in claims if claim is not None]))
    finally:
        await close_storage()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
