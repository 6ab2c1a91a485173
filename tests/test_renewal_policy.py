"""The renewal policy and the maintenance calendar the schedulers plan with: when a certificate is due, how failures
back off, where a suppression starts and ends (across daylight saving changes)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from cryptography import x509

from certlm.lifecycle.renewal import backoff, renewal_reason
from certlm.lifecycle.suppression import BOUNDARY_PRECISION, MaintenanceCalendar
from tests.crypto_factory import Credential, ec_key, make_ca
from tests.support import Rule, Window

NOW = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)
BERLIN = ZoneInfo("Europe/Berlin")


def device_certificate(issuer: Credential, expires: datetime) -> x509.Certificate:
    return issuer.issue("plc-1", ec_key().public_key(), not_before=expires - timedelta(days=365), not_after=expires)


def test_a_certificate_is_due_renewal_days_before_it_expires() -> None:
    ca = make_ca("Plant CA")
    cert = device_certificate(ca, NOW + timedelta(days=30, hours=1))
    due = dict(renewal_days=30, look_ahead_until=NOW, revoked=False, pki_cas=(ca.certificate,))
    assert renewal_reason(cert, now=NOW, **due) is None
    assert "renewal_days 30" in renewal_reason(cert, now=NOW + timedelta(hours=1), **due)
    # The entry's own renewal_days is what the caller passes: 0 renews only what has expired.
    assert renewal_reason(cert, now=NOW + timedelta(days=30), **{**due, "renewal_days": 0}) is None


def test_a_revoked_certificate_or_one_of_another_pki_is_due_at_once() -> None:
    ca, other = make_ca("Plant CA"), make_ca("Old CA")
    cert = device_certificate(ca, NOW + timedelta(days=300))
    kwargs = dict(renewal_days=30, now=NOW, look_ahead_until=NOW)
    assert renewal_reason(cert, revoked=True, pki_cas=(ca.certificate,), **kwargs) == "the certificate is revoked"
    assert "not issued by the entry's PKI" in renewal_reason(
        cert, revoked=False, pki_cas=(other.certificate,), **kwargs
    )
    # A PKI whose CA chain is not known (yet) swaps nothing.
    assert renewal_reason(cert, revoked=None, pki_cas=(), **kwargs) is None


def test_a_certificate_that_becomes_due_during_a_coming_suppression_is_renewed_before_it() -> None:
    ca = make_ca("Plant CA")
    cert = device_certificate(ca, NOW + timedelta(days=40))
    kwargs = dict(renewal_days=30, now=NOW, revoked=False, pki_cas=(ca.certificate,))
    assert renewal_reason(cert, look_ahead_until=NOW + timedelta(days=9), **kwargs) is None
    reason = renewal_reason(cert, look_ahead_until=NOW + timedelta(days=14), **kwargs)
    assert reason is not None and "during the maintenance suppression" in reason


def test_failures_back_off_doubling_up_to_the_cap() -> None:
    waits = [backoff(n, base_s=300, max_s=3600).total_seconds() for n in range(1, 7)]
    assert waits == [300, 600, 1200, 2400, 3600, 3600]


def calendar(*windows: tuple[Window, list[Rule]]) -> MaintenanceCalendar:
    return MaintenanceCalendar(list(windows))  # type: ignore[arg-type]


def close_to(actual: datetime, expected: datetime) -> bool:
    return abs(actual - expected) <= BOUNDARY_PRECISION


def test_a_suppression_ends_when_the_last_overlapping_window_closes() -> None:
    shutdown = Window(1, "Shutdown")
    overtime = Window(2, "Overtime")
    plant = calendar(
        (shutdown, [Rule(1, start_at=NOW - timedelta(hours=1), end_at=NOW + timedelta(hours=2))]),
        (overtime, [Rule(2, start_at=NOW + timedelta(hours=1), end_at=NOW + timedelta(hours=5))]),
    )
    suppression = plant.suppression_at(NOW)
    assert suppression is not None and suppression.window_name == "Shutdown"
    assert close_to(suppression.end, NOW + timedelta(hours=5))
    assert plant.suppression_at(NOW + timedelta(hours=5, minutes=1)) is None


def test_the_next_suppression_is_found_within_the_look_ahead_only() -> None:
    plant = calendar(
        (Window(1, "Shutdown"), [Rule(1, start_at=NOW + timedelta(hours=3), end_at=NOW + timedelta(days=2))])
    )
    assert plant.next_suppression(NOW, timedelta(hours=2)) is None
    coming = plant.next_suppression(NOW, timedelta(hours=4))
    assert coming is not None
    assert close_to(coming.start, NOW + timedelta(hours=3)) and close_to(coming.end, NOW + timedelta(days=2))


def test_an_inactive_window_suppresses_nothing() -> None:
    plant = calendar(
        (
            Window(1, "Off", status="inactive"),
            [Rule(1, start_at=NOW - timedelta(hours=1), end_at=NOW + timedelta(hours=1))],
        )
    )
    assert plant.suppression_at(NOW) is None


def test_a_nightly_window_across_the_autumn_change_lasts_an_hour_longer() -> None:
    # Berlin, 25 October 2026: the clock goes back from 03:00 CEST to 02:00 CET. 01:00-04:00 wall clock is four hours.
    nightly = calendar((Window(1, "Night"), [Rule(1, recurrence_type="daily", start_time="01:00", end_time="04:00")]))
    start = datetime(2026, 10, 25, 1, 0, tzinfo=BERLIN).astimezone(UTC)
    suppression = nightly.suppression_at(start + timedelta(minutes=1))
    assert suppression is not None
    assert close_to(suppression.end, start + timedelta(hours=4))


def test_a_nightly_window_across_the_spring_change_lasts_an_hour_less() -> None:
    # Berlin, 29 March 2026: the clock jumps from 02:00 CET to 03:00 CEST. 01:00-04:00 wall clock is two hours.
    nightly = calendar((Window(1, "Night"), [Rule(1, recurrence_type="daily", start_time="01:00", end_time="04:00")]))
    before = datetime(2026, 3, 29, 0, 30, tzinfo=BERLIN).astimezone(UTC)
    coming = nightly.next_suppression(before, timedelta(hours=1))
    assert coming is not None
    assert close_to(coming.start, datetime(2026, 3, 29, 0, 0, tzinfo=UTC))  # 01:00 CET
    assert close_to(coming.end, datetime(2026, 3, 29, 2, 0, tzinfo=UTC))  # 04:00 CEST
