"""What a named API key costs per request: requests per second of ``GET /gds/systeminfo`` with the service's key (a
compare in memory) and with a named key (``POST /apikeys``: one indexed look-up of its hash per request), in
interleaved rounds on one ``certlm serve``, on SQLite and then on PostgreSQL.

    .venv/bin/python bench/bench_named_keys.py [--rounds 5] [--requests 400] [--clients 8] [--skip-postgres]

It prints each key's median rate over the rounds (with the slowest and fastest round) and the named key's cost as a
percentage of the service key's rate.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from common import LicenseKeys, PostgresServer, start_certlm


async def rate(client: httpx.AsyncClient, requests: int, clients: int) -> float:
    """Requests per second of ``requests`` GETs by ``clients`` concurrent loops sharing one counter."""
    counter = itertools.count()

    async def loop() -> None:
        while next(counter) < requests:
            response = await client.get("/gds/systeminfo")
            assert response.status_code == 200, response.text

    start = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(clients)))
    return requests / (time.perf_counter() - start)


async def measure(engine: str, database_url: str | None, directory: Path, options: argparse.Namespace) -> None:
    license_keys = LicenseKeys.create(directory / "license-keys")
    service = await start_certlm(directory / engine, license_keys, database_url=database_url)
    try:
        async with service.client() as administrator:
            response = await administrator.post("/apikeys", json={"name": "bench", "role": "viewer"})
            assert response.status_code == 201, response.text
            named_key = response.json()["key"]
        rates: dict[str, list[float]] = {"service key": [], "named key": []}
        async with service.client() as service_key, service.client(api_key=named_key) as named:
            clients = {"service key": service_key, "named key": named}
            for client in clients.values():  # warm up: connections, caches
                await rate(client, 100, options.clients)
            for _ in range(options.rounds):
                for name, client in clients.items():
                    rates[name].append(await rate(client, options.requests, options.clients))
        medians = {name: statistics.median(values) for name, values in rates.items()}
        for name, values in rates.items():
            spread = f"rounds {min(values):.0f} to {max(values):.0f}"
            print(f"{engine:10} {name:12} median {medians[name]:6.0f} req/s ({spread})")
        cost = 1 - medians["named key"] / medians["service key"]
        print(f"{engine:10} a named key costs {cost:.1%} of the service key's rate")
    finally:
        await service.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=400, help="requests per key per round")
    parser.add_argument("--clients", type=int, default=8, help="concurrent requests")
    parser.add_argument("--skip-postgres", action="store_true")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-named-keys-") as directory:
        await measure("sqlite", None, Path(directory), options)
        if not options.skip_postgres:
            postgres = PostgresServer()
            postgres.start()
            try:
                await measure("postgresql", postgres.create_database(), Path(directory), options)
            finally:
                postgres.stop()


if __name__ == "__main__":
    asyncio.run(main())
