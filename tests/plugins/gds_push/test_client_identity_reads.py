"""certlm's OPC UA client identity is read from the database again ``REFRESH_S`` after its last read: once, however
many sessions are being opened at that moment (a monitor scan has one under way per slot of its concurrency)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
from certlm_gds_push import identity
from cryptography.hazmat.primitives import serialization

from certlm.testing.running import eventually
from tests.plugins.gds_push.conftest import host_services, make_client_identity

CALLERS = 8


async def asked(value: bool) -> bool:
    return value


class Clock:
    """``time.monotonic`` as the identity holder sees it, moved on by the test instead of waited for."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


async def test_concurrent_callers_after_the_refresh_share_one_database_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    services = host_services(tmp_path)
    made = make_client_identity(None)
    stored = SimpleNamespace(
        application_uri=made.application_uri,
        certificate_der=made.certificate_der,
        chain_der=[],
        private_key_enc=services.secrets.encrypt(
            made.private_key.private_bytes(
                serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        ),
    )
    reads: list[asyncio.Event] = []

    async def stored_client_identity() -> SimpleNamespace:
        answered = asyncio.Event()
        reads.append(answered)
        await answered.wait()  # the database answers when the test says: every caller is waiting by then
        return stored

    clock = Clock()
    monkeypatch.setattr(identity, "time", clock)
    monkeypatch.setattr(identity, "stored_client_identity", stored_client_identity)
    holder = identity.GdsClientCertificate(services)

    for refresh in (1, 2):
        callers = [asyncio.create_task(holder.identity()) for _ in range(CALLERS)]
        # Polled every 0.2 s: by the first poll every caller has run up to its read or its wait for one.
        await eventually(lambda refresh=refresh: asked(len(reads) >= refresh), "a database read", timeout=5)
        for answered in reads:
            answered.set()
        presented = await asyncio.gather(*callers)

        assert len(reads) == refresh, f"{len(reads)} database reads for {CALLERS} callers after refresh {refresh}"
        assert {caller.certificate_der for caller in presented} == {made.certificate_der}
        assert await holder.identity() is presented[0], "within REFRESH_S the identity in memory is presented"
        assert len(reads) == refresh
        clock.now += identity.REFRESH_S
