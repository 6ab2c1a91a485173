"""Revocation checking (``certlm.pki.revocation``): each of the thirteen CRL check statuses with a CA and CRL made for
it, which status wins when several apply, the CRL cache honouring nextUpdate, and a device of the internal CA whose
certificate is revoked, as monitoring and the certificate detail show it."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import quote

import pytest
from certlm_opcua_simulator import SimulatedDevice, SimulatorConfig
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

import certlm.pki.revocation
from certlm.contracts.pki_backends import PkiBackend
from certlm.contracts.registry import PkiBackendRegistry
from certlm.foundation import crl_status
from certlm.foundation.certs import key_usage, serial_hex
from certlm.foundation.errors import UpstreamUnavailable
from certlm.pki.revocation import (
    INLINE_CRL_ENTRIES,
    CrlCache,
    RevocationCheck,
    check,
    revocation_of,
    store_revocation,
)
from certlm.storage.models import InventoryEntry, PkiEntry
from tests.crypto_factory import Credential, certificate, ec_key, make_ca
from tests.support import InProcessApp, free_port, serving

NOW = datetime.now(UTC)
ADMIN = {"username": "admin", "password": "admin-pw"}  # the simulator's administrator


def device_of(ca: Credential, **options) -> x509.Certificate:
    return ca.issue("press-7", ec_key().public_key(), ca=False, key_identifiers=True, **options)


def crl_of(
    ca: Credential,
    revoked: dict[x509.Certificate, x509.ReasonFlags | None] | None = None,
    *,
    this_update: datetime = NOW - timedelta(minutes=5),
    next_update: datetime = NOW + timedelta(days=7),
    signed_by: Credential | None = None,
    names_key_of: Credential | None = None,
) -> x509.CertificateRevocationList:
    """``ca``'s CRL listing ``revoked`` (a reason, or None for an entry without CRLReason), signed by ``signed_by``
    (default ``ca``), naming the key of ``names_key_of`` (default the signer) as its authority key identifier."""
    signer = signed_by or ca
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.certificate.subject)
        .last_update(this_update)
        .next_update(next_update)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key((names_key_of or signer).key.public_key()),
            critical=False,
        )
    )
    for listed, reason in (revoked or {}).items():
        entry = x509.RevokedCertificateBuilder().serial_number(listed.serial_number).revocation_date(NOW)
        if reason is not None:
            entry = entry.add_extension(x509.CRLReason(reason), critical=False)
        builder = builder.add_revoked_certificate(entry.build())
    return builder.sign(signer.key, hashes.SHA256())


def der(item: x509.Certificate | x509.CertificateRevocationList) -> bytes:
    return item.public_bytes(serialization.Encoding.DER)


@pytest.fixture(scope="module")
def root() -> Credential:
    return make_ca("Plant Root CA")


@pytest.fixture(scope="module")
def device(root: Credential) -> x509.Certificate:
    return device_of(root)


def status_name(outcome: RevocationCheck) -> str:
    return crl_status.crl_check_status(outcome.status_id).name


# One test per status, each with the CA and CRL made for it.


def test_not_revoked(root: Credential, device: x509.Certificate) -> None:
    other = device_of(root)
    outcome = check(device, [root.certificate], [crl_of(root, {other: x509.ReasonFlags.superseded})], NOW)
    assert status_name(outcome) == "not_revoked"
    assert outcome.reason is None and outcome.is_revoked is False
    assert f"serial {serial_hex(device)} is not on the CRL" in outcome.detail


def test_revoked_with_the_reason_of_the_crl_entry(root: Credential, device: x509.Certificate) -> None:
    crl = crl_of(root, {device: x509.ReasonFlags.key_compromise})
    outcome = check(device, [root.certificate], [crl], NOW)
    assert status_name(outcome) == "revoked" and outcome.is_revoked is True
    assert outcome.reason is x509.ReasonFlags.key_compromise and outcome.reason_id == 1
    assert outcome.revoked_at == NOW.replace(microsecond=0)


def test_revoked_without_a_reason_is_unspecified(root: Credential, device: x509.Certificate) -> None:
    outcome = check(device, [root.certificate], [crl_of(root, {device: None})], NOW)
    assert status_name(outcome) == "revoked"
    assert outcome.reason is x509.ReasonFlags.unspecified and outcome.reason_id == 0


def test_taken_off_hold_is_not_revoked(root: Credential, device: x509.Certificate) -> None:
    outcome = check(device, [root.certificate], [crl_of(root, {device: x509.ReasonFlags.remove_from_crl})], NOW)
    assert status_name(outcome) == "not_revoked"


def test_certificate_missing(root: Credential) -> None:
    assert status_name(check(None, [root.certificate], [crl_of(root)], NOW)) == "certificate_missing"


def test_crl_missing(root: Credential, device: x509.Certificate) -> None:
    outcome = check(device, [root.certificate], [], NOW)
    assert status_name(outcome) == "crl_missing" and outcome.detail == "the PKI published no CRL"


def test_ca_missing(root: Credential, device: x509.Certificate) -> None:
    stranger = make_ca("Another Plant CA")
    outcome = check(device, [stranger.certificate], [crl_of(stranger)], NOW)
    assert status_name(outcome) == "ca_missing"
    assert "CN=Plant Root CA" in outcome.detail


def test_cert_chain_invalid_when_the_issuer_did_not_sign_it(root: Credential) -> None:
    # Named after the root, signed by another key: a forgery, or a CA that was re-keyed.
    forged = certificate("press-7", ec_key().public_key(), ec_key(), issuer=root.certificate.subject, ca=False)
    outcome = check(forged, [root.certificate], [crl_of(root)], NOW)
    assert status_name(outcome) == "cert_chain_invalid"
    assert "does not verify with the key of CN=Plant Root CA" in outcome.detail


def test_cert_chain_invalid_when_the_path_above_the_issuer_does_not_verify(root: Credential) -> None:
    intermediate = make_ca("Line CA", issuer=make_ca("Plant Root CA"))  # a root of the same name, another key
    outcome = check(device_of(intermediate), [intermediate.certificate, root.certificate], [crl_of(intermediate)], NOW)
    assert status_name(outcome) == "cert_chain_invalid"
    assert "the signature of CN=Line CA does not verify" in outcome.detail


def test_cert_chain_invalid_when_the_issuer_is_no_ca() -> None:
    not_a_ca = make_ca("Press 7 itself", ca=False)
    outcome = check(device_of(not_a_ca), [not_a_ca.certificate], [crl_of(not_a_ca)], NOW)
    assert status_name(outcome) == "cert_chain_invalid"
    assert "is not a CA" in outcome.detail


def test_ca_crlsign_missing() -> None:
    ca = make_ca("Issuing Only CA", key_usage=key_usage(digital_signature=True, key_cert_sign=True))
    outcome = check(device_of(ca), [ca.certificate], [crl_of(ca)], NOW)
    assert status_name(outcome) == "ca_crlsign_missing"


def test_crl_issuer_mismatch_when_no_crl_names_the_issuer(root: Credential, device: x509.Certificate) -> None:
    outcome = check(device, [root.certificate], [crl_of(make_ca("Another Plant CA"))], NOW)
    assert status_name(outcome) == "crl_issuer_mismatch"
    assert "the PKI's CRLs are of CN=Another Plant CA" in outcome.detail


def test_crl_issuer_mismatch_when_the_crl_is_of_another_key_of_that_name(
    root: Credential, device: x509.Certificate
) -> None:
    namesake = make_ca("Plant Root CA")
    outcome = check(device, [root.certificate], [crl_of(namesake)], NOW)
    assert status_name(outcome) == "crl_issuer_mismatch"
    assert "another key of that name" in outcome.detail


def test_crl_signature_invalid(root: Credential, device: x509.Certificate) -> None:
    # The CRL names the root and the root's key, but another key signed it.
    forged = crl_of(root, {device: None}, signed_by=make_ca("Plant Root CA"), names_key_of=root)
    outcome = check(device, [root.certificate], [forged], NOW)
    assert status_name(outcome) == "crl_signature_invalid"


@pytest.mark.parametrize(
    ("this_update", "next_update"),
    [(NOW + timedelta(hours=1), NOW + timedelta(days=7)), (NOW - timedelta(days=8), NOW - timedelta(days=1))],
    ids=["not yet valid", "expired"],
)
def test_crl_time_invalid(
    root: Credential, device: x509.Certificate, this_update: datetime, next_update: datetime
) -> None:
    crl = crl_of(root, {device: x509.ReasonFlags.key_compromise}, this_update=this_update, next_update=next_update)
    outcome = check(device, [root.certificate], [crl], NOW)
    assert status_name(outcome) == "crl_time_invalid" and outcome.is_revoked is None


@pytest.mark.parametrize("broken", ["certificate", "ca", "crl"])
def test_parsing_error(root: Credential, device: x509.Certificate, broken: str) -> None:
    garbage = b"\x30\x03\x02\x01"
    inputs = {"certificate": der(device), "ca": der(root.certificate), "crl": der(crl_of(root))} | {broken: garbage}
    outcome = check(inputs["certificate"], [inputs["ca"]], [inputs["crl"]], NOW)
    assert status_name(outcome) == "parsing_error"


def test_der_and_pem_bytes_are_checked_like_parsed_objects(root: Credential, device: x509.Certificate) -> None:
    crl = crl_of(root, {device: x509.ReasonFlags.superseded})
    pem = root.certificate.public_bytes(serialization.Encoding.PEM)
    outcome = check(der(device), [pem], [der(crl)], NOW)
    assert status_name(outcome) == "revoked" and outcome.reason is x509.ReasonFlags.superseded


def test_self_signed() -> None:
    own_key = ec_key()
    factory = certificate("press-7 factory certificate", own_key.public_key(), own_key)
    assert status_name(check(factory, [], [], NOW)) == "self_signed"


def test_unknown_without_a_source_of_crls(root: Credential, device: x509.Certificate) -> None:
    assert status_name(check(device, [root.certificate], None, NOW)) == "unknown"


# Which status wins when several apply: the order of the module docstring.


def test_a_self_signed_certificate_needs_no_pki() -> None:
    own_key = ec_key()
    factory = certificate("factory", own_key.public_key(), own_key)
    assert status_name(check(factory, [], None, NOW)) == "self_signed"


def test_a_missing_ca_wins_over_a_missing_crl(device: x509.Certificate) -> None:
    assert status_name(check(device, [], [], NOW)) == "ca_missing"


def test_an_out_of_date_crl_tells_nothing_about_revocation(root: Credential, device: x509.Certificate) -> None:
    expired = crl_of(root, {device: None}, this_update=NOW - timedelta(days=9), next_update=NOW - timedelta(days=2))
    assert status_name(check(device, [root.certificate], [expired], NOW)) == "crl_time_invalid"


def test_the_newest_current_crl_decides(root: Credential, device: x509.Certificate) -> None:
    older = crl_of(root, this_update=NOW - timedelta(days=2))
    newer = crl_of(root, {device: x509.ReasonFlags.cessation_of_operation}, this_update=NOW - timedelta(hours=1))
    outcome = check(device, [root.certificate], [newer, older], NOW)
    assert outcome.reason is x509.ReasonFlags.cessation_of_operation


def test_an_intermediate_ca_is_checked_up_to_the_root(root: Credential) -> None:
    intermediate = make_ca("Line CA", issuer=root)
    issued = device_of(intermediate)
    crl = crl_of(intermediate, {issued: x509.ReasonFlags.affiliation_changed})
    assert check(issued, [intermediate.certificate, root.certificate], [crl], NOW).reason_id == 3
    # A PKI that hands out only its issuing CA: that CA is the trust anchor.
    assert status_name(check(issued, [intermediate.certificate], [crl], NOW)) == "revoked"


# The CRL cache: one fetch per PKI entry until the CRL's nextUpdate.


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> datetime:
        return self.now


class CountingPki(PkiBackend):
    """A PKI whose CRL is whatever the test sets (an exception is raised), counting the fetches."""

    pki_type = 99
    name = "counting"

    def __init__(self, ca: Credential) -> None:
        super().__init__(services=None)  # type: ignore[arg-type]
        self.ca = ca
        self.current: x509.CertificateRevocationList | Exception = crl_of(ca)
        self.fetches = 0

    async def ca_certificates(self, entry: PkiEntry) -> list[x509.Certificate]:
        return [self.ca.certificate]

    async def crl(self, entry: PkiEntry) -> x509.CertificateRevocationList:
        self.fetches += 1
        await asyncio.sleep(0)  # a fetch takes a while: concurrent checks must wait for the same one
        if isinstance(self.current, Exception):
            raise self.current
        return self.current


def pki_entry(updated_at: datetime = NOW) -> PkiEntry:
    return PkiEntry(id=7, pki_type=CountingPki.pki_type, pki_connection="ca.plant:443", updated_at=updated_at)


async def test_the_crl_is_kept_until_its_next_update(root: Credential) -> None:
    clock, backend = Clock(), CountingPki(root)
    backend.current = crl_of(root, next_update=NOW + timedelta(minutes=30))
    cache = CrlCache(clock=clock)
    await asyncio.gather(*(cache.sources(pki_entry(), backend) for _ in range(5)))
    assert backend.fetches == 1
    clock.now = NOW + timedelta(minutes=29)
    await cache.sources(pki_entry(), backend)
    assert backend.fetches == 1
    clock.now = NOW + timedelta(minutes=31)
    await cache.sources(pki_entry(), backend)
    assert backend.fetches == 2


async def test_a_long_lived_crl_is_fetched_again_within_the_maximum_age(root: Credential) -> None:
    clock, backend = Clock(), CountingPki(root)  # nextUpdate in a week, as the internal CA's
    cache = CrlCache(clock=clock, max_age=timedelta(hours=1))
    await cache.sources(pki_entry(), backend)
    clock.now = NOW + timedelta(minutes=61)
    await cache.sources(pki_entry(), backend)
    assert backend.fetches == 2


async def test_a_changed_or_forgotten_pki_entry_is_fetched_again(root: Credential) -> None:
    backend, cache = CountingPki(root), CrlCache(clock=Clock())
    await cache.sources(pki_entry(), backend)
    await cache.sources(pki_entry(updated_at=NOW + timedelta(seconds=1)), backend)
    assert backend.fetches == 2
    cache.forget(7)
    await cache.sources(pki_entry(updated_at=NOW + timedelta(seconds=1)), backend)
    assert backend.fetches == 3


async def test_an_unreachable_pki_is_asked_again_after_a_few_minutes(root: Credential) -> None:
    clock, backend = Clock(), CountingPki(root)
    backend.current = UpstreamUnavailable("ca.plant:443: connection refused")
    cache = CrlCache(clock=clock, short_age=timedelta(minutes=5))
    sources = await cache.sources(pki_entry(), backend)
    assert sources.crls == () and sources.problems == ("PKI entry 7 gave no CRL: ca.plant:443: connection refused",)
    clock.now = NOW + timedelta(minutes=4)
    await cache.sources(pki_entry(), backend)
    assert backend.fetches == 1
    clock.now = NOW + timedelta(minutes=6)
    backend.current = crl_of(root)
    assert (await cache.sources(pki_entry(), backend)).crls == (backend.current,)


# The signatures of a fetched CA chain and CRL are verified once per fetch; the rest of the check at every visit.


def registry_of(ca: Credential) -> tuple[PkiBackendRegistry, CountingPki]:
    class Counting(CountingPki):
        def __init__(self, services: object) -> None:
            super().__init__(ca)

    registry = PkiBackendRegistry()
    registry.add(Counting)
    registry.instantiate(None)  # type: ignore[arg-type]
    return registry, registry.get(CountingPki.pki_type)  # type: ignore[return-value]


class Checker:
    """``revocation_of`` for one entry of PKI entry 7 (``CountingPki``), with the CRL cache a monitor uses."""

    def __init__(self, ca: Credential) -> None:
        self.backends, self.pki = registry_of(ca)
        self.cache = CrlCache(clock=Clock())
        self.entry = SimpleNamespace(id=1, pki_id=7)  # all of an inventory entry that the check reads

    async def __call__(self, certificate: x509.Certificate, now: datetime = NOW) -> str:
        outcome = await revocation_of(
            self.entry,  # type: ignore[arg-type]
            certificate,
            self.backends,
            self.cache,
            now,
            pkis={7: pki_entry()},
        )
        return status_name(outcome)


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The checks that ran off the event loop, by the name of what ran."""
    ran: list[str] = []
    real = asyncio.to_thread

    async def counted(function, *args, **kwargs):
        ran.append(function.__name__)
        return await real(function, *args, **kwargs)

    monkeypatch.setattr(certlm.pki.revocation.asyncio, "to_thread", counted)
    return ran


@pytest.fixture
def verifications(monkeypatch: pytest.MonkeyPatch) -> list[x509.CertificateRevocationList]:
    """The CRLs whose signature the checks verify, one item per verification."""
    verified: list[x509.CertificateRevocationList] = []
    real = certlm.pki.revocation._signature_valid

    def counted(crl: x509.CertificateRevocationList, issuer: x509.Certificate) -> bool:
        verified.append(crl)
        return real(crl, issuer)

    monkeypatch.setattr(certlm.pki.revocation, "_signature_valid", counted)
    return verified


async def test_a_crl_s_signature_is_verified_once_while_each_check_still_decides(
    root: Credential, device: x509.Certificate, verifications: list, threads: list
) -> None:
    checker = Checker(root)
    checker.pki.current = crl_of(root, {device: x509.ReasonFlags.key_compromise})
    other = device_of(root)
    assert [await checker(device), await checker(other), await checker(device)] == [
        "revoked",
        "not_revoked",
        "revoked",
    ]
    assert verifications == [checker.pki.current]
    # The first check verified the signatures off the event loop; the others, with little left to do, ran on it.
    assert threads == ["check_subject"]


async def test_a_crl_replaced_by_a_new_one_is_used_at_once(
    root: Credential, device: x509.Certificate, verifications: list
) -> None:
    checker = Checker(root)
    assert await checker(device) == "not_revoked"
    # The device's key leaked: the CA publishes a CRL listing it, and the cache is told to fetch again.
    checker.pki.current = crl_of(root, {device: x509.ReasonFlags.key_compromise})
    checker.cache.forget(7)
    assert await checker(device) == "revoked"
    assert len(verifications) == 2 and verifications[-1] is checker.pki.current


async def test_a_forged_crl_is_refused_after_a_good_one_of_the_same_issuer_was_verified(
    root: Credential, device: x509.Certificate
) -> None:
    checker = Checker(root)
    good = checker.pki.current
    assert [await checker(device), await checker(device)] == ["not_revoked", "not_revoked"]
    # The same bytes signed by another key, naming the root and its key: no answer about the good CRL applies to it.
    checker.pki.current = crl_of(root, signed_by=make_ca("Plant Root CA"), names_key_of=root)
    checker.cache.forget(7)
    assert [await checker(device), await checker(device)] == ["crl_signature_invalid"] * 2
    # Whichever came first: a check of the forged CRL alone, and one of both, where the good one decides.
    assert status_name(check(device, [root.certificate], [checker.pki.current], NOW)) == "crl_signature_invalid"
    assert status_name(check(device, [root.certificate], [checker.pki.current, good], NOW)) == "not_revoked"


async def test_a_crl_verified_before_is_reported_expired_once_its_next_update_passed(
    root: Credential, device: x509.Certificate, verifications: list
) -> None:
    checker = Checker(root)
    checker.pki.current = crl_of(root, {device: None}, next_update=NOW + timedelta(hours=1))
    assert await checker(device) == "revoked"
    # The cache still holds the CRL (its clock stands still); the check's time is past the CRL's nextUpdate.
    assert await checker(device, NOW + timedelta(hours=2)) == "crl_time_invalid"
    assert len(verifications) == 1


async def test_what_every_device_of_an_issuer_is_decided_by_alike_is_decided_once_per_fetch(
    root: Credential, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The path above the issuing CA, its keyUsage and which of its CRLs verify are decided once per fetch of the CA
    chain and CRL (``SignatureMemo.of_issuer``), not once per device: left for each device are its own signature, its
    place on the CRL and the CRL's time, and the answers stay each device's own."""
    decided: list[x509.Certificate] = []
    real = certlm.pki.revocation._issuer_crls

    def counted(issuer: x509.Certificate, *args: object) -> object:
        decided.append(issuer)
        return real(issuer, *args)

    monkeypatch.setattr(certlm.pki.revocation, "_issuer_crls", counted)
    devices = [device_of(root) for _ in range(4)]
    checker = Checker(root)
    checker.pki.current = crl_of(
        root, {devices[1]: x509.ReasonFlags.key_compromise}, next_update=NOW + timedelta(hours=1)
    )
    assert [await checker(device) for device in devices] == ["not_revoked", "revoked", "not_revoked", "not_revoked"]
    assert await checker(devices[0], NOW + timedelta(hours=2)) == "crl_time_invalid"
    assert decided == [root.certificate]
    # Copies of that chain and CRL are not the memo's objects (their identities may be reused): decided every time.
    memo = checker.cache._cached[7].sources.verified
    ca_copy = x509.load_der_x509_certificate(root.certificate.public_bytes(serialization.Encoding.DER))
    crl_copy = x509.load_der_x509_crl(checker.pki.current.public_bytes(serialization.Encoding.DER))
    assert status_name(check(devices[1], [ca_copy], [crl_copy], NOW, memo)) == "revoked"
    assert status_name(check(devices[1], [ca_copy], [crl_copy], NOW, memo)) == "revoked"
    assert len(decided) == 3


Listed = collections.namedtuple("Listed", "serial_number")


async def test_a_long_crl_is_searched_off_the_event_loop_every_time(
    root: Credential, verifications: list, threads: list
) -> None:
    devices = [device_of(root) for _ in range(3)]
    padding = [Listed(serial) for serial in range(1, INLINE_CRL_ENTRIES + 1)]  # device serials are 159-bit random
    revoked: dict = {devices[0]: x509.ReasonFlags.superseded, **dict.fromkeys(padding, None)}
    checker = Checker(root)
    checker.pki.current = crl_of(root, revoked)
    assert len(checker.pki.current) > INLINE_CRL_ENTRIES
    assert [await checker(device) for device in devices] == ["revoked", "not_revoked", "not_revoked"]
    assert len(verifications) == 1 and threads == ["check_subject"] * 3


# Through the app: an entry without a PKI, and a device of the internal CA revoked for a compromised key.


@pytest.fixture
async def app(in_process: InProcessApp) -> tuple:
    await in_process.create_internal_ca()
    return in_process.client, in_process.headers, in_process.host


@pytest.fixture
async def plc(tmp_path: Path) -> AsyncIterator[SimulatedDevice]:
    config = SimulatorConfig(state_dir=tmp_path / "device", port=free_port(), auto_accept=True, apply_delay_s=0.1)
    simulated = SimulatedDevice(config)
    await simulated.start()
    try:
        yield simulated
    finally:
        await simulated.stop()


async def test_an_entry_without_a_pki_has_an_unknown_status(app, device: x509.Certificate) -> None:
    client, _, host = app
    async with client.app.app_context():
        entry = await InventoryEntry.create(protocol="gds", service="gds-push-generic", server="plc-9", port=4840)
        outcome = await revocation_of(entry, der(device), host.pki_backends, host.crl_cache)
    assert status_name(outcome) == "unknown" and outcome.detail == "the entry has no PKI"


async def test_a_revoked_device_certificate_shows_revoked_with_its_reason(app, plc: SimulatedDevice) -> None:
    client, headers, host = app
    address = {"server": "127.0.0.1", "port": plc.config.port}
    onboarded = await client.post("/gds/push/onboarding", json={**address, **ADMIN}, headers=headers)
    assert onboarded.status_code == 200, await onboarded.get_data(as_text=True)
    detail_path = f"/gds/inventory/crt/{quote(plc.url, safe='')}"
    detail = await (await client.get(detail_path, headers=headers)).get_json()
    assert detail["certificate_revocation"]["name"] == "not_revoked"
    assert detail["certificate_revocation_reason"] is None

    # The operator learns that the device's key leaked and revokes its certificate at the internal CA.
    async with client.app.app_context():
        pki = await PkiEntry.get(pki_type=1)
        await host.pki_backends.get(1).revoke(pki, plc.certificate, x509.ReasonFlags.key_compromise)

    monitor_body = {"server": "127.0.0.1", "port": str(plc.config.port)}  # the spec's port is a string here
    monitored = await client.post("/gds/monitor/crt", json=monitor_body, headers=headers)
    assert monitored.status_code == 200, await monitored.get_data(as_text=True)
    detail = await (await client.get(detail_path, headers=headers)).get_json()
    assert detail["certificate_revocation"] == {
        "id": crl_status.REVOKED,
        "name": "revoked",
        "description": "Certificate is on the issuer's CRL",
        "is_revoked": True,
    }
    assert detail["certificate_revocation_reason"] == {
        "id": 1,
        "name": "keyCompromise",
        "description": "The private key was compromised",
    }
    entry = await (await client.get(f"/gds/inventory/{quote(plc.url, safe='')}", headers=headers)).get_json()
    assert entry["cert_revoked"] is True

    # Monitoring without the CRL check forgets what the last check said, as it always did.
    unchecked = await client.post("/gds/monitor/crt", json={**monitor_body, "disable_crl_check": True}, headers=headers)
    assert unchecked.status_code == 200
    detail = await (await client.get(detail_path, headers=headers)).get_json()
    assert detail["certificate_revocation"]["name"] == "unknown"
    assert detail["certificate_revocation_reason"] is None
    entry = await (await client.get(f"/gds/inventory/{quote(plc.url, safe='')}", headers=headers)).get_json()
    assert entry["cert_revoked"] is None


@pytest.mark.parametrize("published", ["forged", "another CA's"])
async def test_a_fetched_crl_that_does_not_verify_is_reported_as_such_not_as_missing(
    app, root: Credential, device: x509.Certificate, published: str
) -> None:
    """An EST PKI whose distribution point serves a CRL naming the root and its key but signed by another key (or a
    CRL of another CA): the check says so, with where the CRL came from, instead of "no CRL"."""
    client, headers, host = app
    if published == "forged":
        crl = crl_of(root, signed_by=make_ca("Plant Root CA"), names_key_of=root)
    else:
        crl = crl_of(make_ca("Another Plant CA"))
    async with serving({"/root.crl": der(crl)}) as cdp, client.app.app_context():
        pki = await PkiEntry.create(
            pki_type=2,  # EST: fetches the CRL from a distribution point, as the CMP backend does
            pki_connection="127.0.0.1:1",
            ca_certificates=[root.certificate.public_bytes(serialization.Encoding.PEM).decode()],
            est_cdp_urls=[f"{cdp}/root.crl"],
        )
        entry = await InventoryEntry.create(
            protocol="gds", service="gds-push-generic", server="plc-9", port=4840, pki_id=pki.id,
            certificate_der=der(device),
        )  # fmt: skip
        outcome = await revocation_of(entry, der(device), host.pki_backends, host.crl_cache)
        store_revocation(entry, outcome)
        await entry.save()
    if published == "forged":
        assert outcome.status_id == crl_status.CRL_SIGNATURE_INVALID == 9
        assert outcome.detail.startswith("the CRL's signature does not verify with the key of CN=Plant Root CA: ")
    else:
        assert status_name(outcome) == "crl_issuer_mismatch"
        assert outcome.detail.startswith("no CRL names the certificate's issuer CN=Plant Root CA; ")
    assert f"{cdp}/root.crl: refused a CRL of" in outcome.detail and outcome.is_revoked is None
    detail = await client.get(f"/gds/inventory/crt/{quote('opc.tcp://plc-9:4840', safe='')}", headers=headers)
    assert detail.status_code == 200
    revocation = (await detail.get_json())["certificate_revocation"]
    assert revocation["id"] == outcome.status_id and revocation["name"] == status_name(outcome)


async def test_the_certificate_detail_says_why_a_monitored_crl_does_not_verify(app, plc: SimulatedDevice) -> None:
    """A device of the internal CA whose entry is moved to an EST PKI that knows the same CA, and whose distribution
    point serves a CRL naming that CA but signed by another key: the monitor's check stores status 9, and the
    certificate detail says why, with where the CRL came from."""
    client, headers, _ = app
    address = {"server": "127.0.0.1", "port": plc.config.port}
    onboarded = await client.post("/gds/push/onboarding", json={**address, **ADMIN}, headers=headers)
    assert onboarded.status_code == 200, await onboarded.get_data(as_text=True)
    ca_pem = await (await client.get("/pki/ca/1")).get_data(as_text=True)
    ca_certificate = x509.load_pem_x509_certificate(ca_pem.encode())
    # The internal CA as the forger sees it: its name and public key, not its private key.
    internal = SimpleNamespace(certificate=ca_certificate, key=SimpleNamespace(public_key=ca_certificate.public_key))
    forged = crl_of(internal, signed_by=make_ca("Plant Root CA"), names_key_of=internal)  # type: ignore[arg-type]
    async with serving({"/internal.crl": der(forged)}) as cdp:
        async with client.app.app_context():
            est = await PkiEntry.create(
                pki_type=2, pki_connection="127.0.0.1:1", ca_certificates=[ca_pem], est_cdp_urls=[f"{cdp}/internal.crl"]
            )
        moved = await client.patch("/gds/inventory", json={**address, "pki": est.id}, headers=headers)
        assert moved.status_code == 200, await moved.get_data(as_text=True)
        monitored = await client.post(
            "/gds/monitor/crt", json={"server": "127.0.0.1", "port": str(plc.config.port)}, headers=headers
        )
        assert monitored.status_code == 200, await monitored.get_data(as_text=True)
    detail = await (await client.get(f"/gds/inventory/crt/{quote(plc.url, safe='')}", headers=headers)).get_json()
    assert detail["certificate_revocation"]["id"] == crl_status.CRL_SIGNATURE_INVALID
    why = detail["certificate_revocation_detail"]
    issuer = ca_certificate.subject.rfc4514_string()
    assert why.startswith(f"the CRL's signature does not verify with the key of {issuer}")
    assert f"{cdp}/internal.crl" in why
