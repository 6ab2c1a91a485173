"""The maintenance window evaluator: each kind of rule, intervals, midnight, and daylight saving changes."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest

from certlm.lifecycle.maintenance import (
    ScheduleError,
    check_cron,
    check_rrule,
    check_rule,
    check_time_of_day,
    check_window,
    local_moment,
    window_contains,
    zone_named,
)
from certlm.lifecycle.suppression import MaintenanceCalendar
from tests.support import Rule, Window

BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")


def inside(window: Window, rule: Rule, at: datetime) -> bool:
    return window_contains(window, [rule], at).inside


def berlin(*args: int) -> datetime:
    return datetime(*args, tzinfo=BERLIN)


def minutes_open(window: Window, rule: Rule, day: date) -> int:
    """How many minutes of the local calendar day the window is open, sampled each real minute."""
    zone = ZoneInfo(window.timezone)
    moment = datetime.combine(day, time(), zone).astimezone(UTC)
    end = datetime.combine(day + timedelta(days=1), time(), zone).astimezone(UTC)
    count = 0
    while moment < end:
        count += inside(window, rule, moment)
        moment += timedelta(minutes=1)
    return count


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


# One-time rules


def test_one_time_rule_is_open_from_start_up_to_end() -> None:
    rule = Rule(start_at=berlin(2026, 5, 1, 10, 0), end_at=berlin(2026, 5, 1, 12, 0))
    assert not inside(Window(), rule, berlin(2026, 5, 1, 9, 59, 59))
    assert inside(Window(), rule, berlin(2026, 5, 1, 10, 0))
    assert inside(Window(), rule, berlin(2026, 5, 1, 11, 59, 59))
    assert not inside(Window(), rule, berlin(2026, 5, 1, 12, 0))
    # 08:30 UTC is 10:30 CEST.
    assert inside(Window(), rule, utc("2026-05-01T08:30:00"))
    assert not inside(Window(), rule, utc("2026-05-01T10:30:00"))


def test_one_time_rule_with_naive_times_reads_them_in_the_window_zone() -> None:
    rule = Rule(start_at=datetime(2026, 5, 1, 10, 0), end_at=datetime(2026, 5, 1, 12, 0))
    window = Window(timezone="America/New_York")
    assert inside(window, rule, utc("2026-05-01T14:30:00"))  # 10:30 EDT
    assert not inside(window, rule, utc("2026-05-01T09:30:00"))  # 10:30 in Berlin, 05:30 in New York


# Daily rules


def test_daily_rule_is_open_between_its_times_every_day() -> None:
    rule = Rule(recurrence_type="daily", start_time="02:00", end_time="03:00")
    assert not inside(Window(), rule, berlin(2026, 6, 10, 1, 59, 59))
    assert inside(Window(), rule, berlin(2026, 6, 10, 2, 0))
    assert inside(Window(), rule, berlin(2026, 6, 11, 2, 59, 59))
    assert not inside(Window(), rule, berlin(2026, 6, 11, 3, 0))
    assert minutes_open(Window(), rule, date(2026, 6, 12)) == 60


def test_daily_interval_counts_from_valid_from() -> None:
    window = Window(valid_from=berlin(2026, 6, 1, 0, 0))
    rule = Rule(recurrence_type="daily", start_time="10:00", end_time="11:00", interval_count=3)
    opened = [day for day in range(1, 11) if inside(window, rule, berlin(2026, 6, day, 10, 30))]
    assert opened == [1, 4, 7, 10]


def test_daily_interval_counts_from_creation_without_valid_from() -> None:
    # Created 2026-01-31 23:30 UTC, which is already 1 February in Berlin.
    window = Window(created_at=datetime(2026, 1, 31, 23, 30, tzinfo=UTC))
    rule = Rule(recurrence_type="daily", start_time="10:00", end_time="11:00", interval_count=2)
    assert inside(window, rule, berlin(2026, 2, 1, 10, 30))
    assert not inside(window, rule, berlin(2026, 2, 2, 10, 30))
    assert inside(window, rule, berlin(2026, 2, 3, 10, 30))


def test_window_ending_before_it_starts_crosses_midnight() -> None:
    window = Window(valid_from=berlin(2026, 6, 1, 0, 0))
    rule = Rule(recurrence_type="daily", start_time="22:00", end_time="02:00", interval_count=2)
    assert not inside(window, rule, berlin(2026, 6, 1, 21, 59))
    assert inside(window, rule, berlin(2026, 6, 1, 22, 0))
    assert inside(window, rule, berlin(2026, 6, 1, 23, 59))
    # After midnight the window of 1 June is still open, although 2 June itself is not a selected day.
    assert inside(window, rule, berlin(2026, 6, 2, 0, 0))
    assert inside(window, rule, berlin(2026, 6, 2, 1, 59, 59))
    assert not inside(window, rule, berlin(2026, 6, 2, 2, 0))
    assert not inside(window, rule, berlin(2026, 6, 2, 23, 0))
    assert not inside(window, rule, berlin(2026, 6, 3, 1, 0))


def test_equal_start_and_end_time_is_a_whole_day() -> None:
    rule = Rule(recurrence_type="daily", start_time="06:00", end_time="06:00")
    assert minutes_open(Window(), rule, date(2026, 6, 10)) == 24 * 60


# Weekly rules


def test_weekly_rule_opens_on_its_day_of_week() -> None:
    rule = Rule(recurrence_type="weekly", day_of_week=0, start_time="08:00", end_time="12:30")
    assert inside(Window(), rule, berlin(2026, 6, 1, 8, 0))  # a Monday
    assert inside(Window(), rule, berlin(2026, 6, 8, 12, 29))
    assert not inside(Window(), rule, berlin(2026, 6, 8, 12, 30))
    assert not inside(Window(), rule, berlin(2026, 6, 2, 9, 0))  # Tuesday
    assert not inside(Window(), rule, berlin(2026, 6, 7, 9, 0))  # Sunday


def test_weekly_rule_crossing_midnight_runs_into_the_next_day() -> None:
    rule = Rule(recurrence_type="weekly", day_of_week=4, start_time="22:00", end_time="02:00")
    assert inside(Window(), rule, berlin(2026, 6, 5, 22, 30))  # Friday night
    assert inside(Window(), rule, berlin(2026, 6, 6, 1, 30))  # Saturday early morning
    assert not inside(Window(), rule, berlin(2026, 6, 6, 22, 30))
    assert not inside(Window(), rule, berlin(2026, 6, 5, 1, 30))  # the Thursday night's window does not exist


def test_weekly_interval_counts_calendar_weeks_from_the_anchor_week() -> None:
    # Valid from a Wednesday: the Friday of that same week is the first of every second week.
    window = Window(valid_from=berlin(2026, 6, 3, 12, 0))
    rule = Rule(recurrence_type="weekly", day_of_week=4, start_time="20:00", end_time="21:00", interval_count=2)
    fridays = [date(2026, 6, 5) + timedelta(weeks=n) for n in range(5)]
    opened = [day for day in fridays if inside(window, rule, datetime.combine(day, time(20, 30), BERLIN))]
    assert opened == [date(2026, 6, 5), date(2026, 6, 19), date(2026, 7, 3)]


# Monthly rules


def test_monthly_rule_clamps_to_the_last_day_of_shorter_months() -> None:
    rule = Rule(recurrence_type="monthly", day_of_month=31, start_time="01:00", end_time="04:00")
    assert inside(Window(), rule, berlin(2026, 1, 31, 2, 0))
    assert inside(Window(), rule, berlin(2026, 4, 30, 2, 0))
    assert not inside(Window(), rule, berlin(2026, 4, 29, 2, 0))
    assert inside(Window(), rule, berlin(2026, 2, 28, 2, 0))
    assert not inside(Window(), rule, berlin(2028, 2, 28, 2, 0))  # a leap year: the 29th is the last day
    assert inside(Window(), rule, berlin(2028, 2, 29, 2, 0))


def test_monthly_rule_without_times_is_the_whole_day() -> None:
    rule = Rule(recurrence_type="monthly", day_of_month=15)
    assert not inside(Window(), rule, berlin(2026, 7, 14, 23, 59, 59))
    assert inside(Window(), rule, berlin(2026, 7, 15, 0, 0))
    assert inside(Window(), rule, berlin(2026, 7, 15, 23, 59, 59))
    assert not inside(Window(), rule, berlin(2026, 7, 16, 0, 0))


def test_monthly_interval_counts_months_from_the_anchor() -> None:
    window = Window(valid_from=berlin(2026, 1, 20, 0, 0))
    rule = Rule(recurrence_type="monthly", day_of_month=31, start_time="01:00", end_time="04:00", interval_count=3)
    last_days = [date(2026, m + 1, 1) - timedelta(days=1) for m in range(1, 12)]
    opened = [day.month for day in last_days if inside(window, rule, datetime.combine(day, time(2), BERLIN))]
    assert opened == [1, 4, 7, 10]


# Cron rules


def test_cron_rule_opens_for_its_duration_after_each_match() -> None:
    rule = Rule(recurrence_type="cron", cron="0 2 * * 1-5", duration_minutes=90)
    assert not inside(Window(), rule, berlin(2026, 6, 1, 1, 59, 59))
    assert inside(Window(), rule, berlin(2026, 6, 1, 2, 0))  # Monday
    assert inside(Window(), rule, berlin(2026, 6, 1, 3, 29, 59))
    assert not inside(Window(), rule, berlin(2026, 6, 1, 3, 30))
    assert not inside(Window(), rule, berlin(2026, 6, 7, 2, 30))  # Sunday


def test_cron_rule_defaults_to_sixty_minutes() -> None:
    rule = Rule(recurrence_type="cron", cron="15 23 * * *")
    assert inside(Window(), rule, berlin(2026, 6, 1, 23, 15))
    assert inside(Window(), rule, berlin(2026, 6, 2, 0, 14, 59))
    assert not inside(Window(), rule, berlin(2026, 6, 2, 0, 15))


def test_cron_occurrences_longer_than_their_spacing_overlap() -> None:
    rule = Rule(recurrence_type="cron", cron="0 */2 * * *", duration_minutes=150)
    assert minutes_open(Window(), rule, date(2026, 6, 10)) == 24 * 60


def test_cron_rule_is_evaluated_on_the_window_clock() -> None:
    rule = Rule(recurrence_type="cron", cron="0 9 * * *", duration_minutes=30)
    window = Window(timezone="America/New_York")
    assert inside(window, rule, utc("2026-07-01T13:10:00"))  # 09:10 EDT
    assert not inside(window, rule, utc("2026-07-01T07:10:00"))  # 09:10 in Berlin
    assert inside(window, rule, utc("2026-01-15T14:10:00"))  # 09:10 EST


# RRULE rules


def test_rrule_occurrences_open_the_window_for_their_duration() -> None:
    rule = Rule(
        recurrence_type="rrule", rrule="DTSTART:20260601T013000\nRRULE:FREQ=WEEKLY;BYDAY=SA", duration_minutes=45
    )
    assert not inside(Window(), rule, berlin(2026, 6, 6, 1, 29))  # Saturday
    assert inside(Window(), rule, berlin(2026, 6, 6, 1, 30))
    assert inside(Window(), rule, berlin(2026, 6, 6, 2, 14, 59))
    assert not inside(Window(), rule, berlin(2026, 6, 6, 2, 15))
    assert not inside(Window(), rule, berlin(2026, 6, 5, 1, 45))  # Friday
    assert not inside(Window(), rule, berlin(2026, 5, 30, 1, 45))  # a Saturday before DTSTART


def test_rrule_without_dtstart_starts_at_midnight_of_the_anchor_date() -> None:
    window = Window(valid_from=berlin(2026, 6, 1, 15, 0))
    rule = Rule(recurrence_type="rrule", rrule="FREQ=DAILY;INTERVAL=2")
    assert not inside(window, rule, berlin(2026, 6, 1, 0, 30))  # before valid_from
    assert not inside(window, rule, berlin(2026, 6, 2, 0, 30))
    assert inside(window, rule, berlin(2026, 6, 3, 0, 30))
    assert not inside(window, rule, berlin(2026, 6, 3, 1, 0))


def test_rrule_with_times_opens_on_the_days_it_selects() -> None:
    rule = Rule(recurrence_type="rrule", rrule="FREQ=MONTHLY;BYDAY=1SU", start_time="01:00", end_time="05:00")
    assert inside(Window(), rule, berlin(2026, 6, 7, 1, 0))  # the first Sunday of June
    assert inside(Window(), rule, berlin(2026, 6, 7, 4, 59))
    assert not inside(Window(), rule, berlin(2026, 6, 7, 5, 0))
    assert not inside(Window(), rule, berlin(2026, 6, 14, 2, 0))
    assert inside(Window(), rule, berlin(2026, 7, 5, 2, 0))


# Daylight saving time


def test_daily_window_in_the_skipped_hour_does_not_open_on_spring_forward_day() -> None:
    # 2026-03-29 in Berlin: 02:00 CET is followed by 03:00 CEST; the clock never shows 02:xx.
    rule = Rule(recurrence_type="daily", start_time="02:00", end_time="03:00")
    assert minutes_open(Window(), rule, date(2026, 3, 28)) == 60
    assert minutes_open(Window(), rule, date(2026, 3, 29)) == 0
    assert minutes_open(Window(), rule, date(2026, 3, 30)) == 60
    assert not inside(Window(), rule, utc("2026-03-29T00:59:59"))  # 01:59:59 CET
    assert not inside(Window(), rule, utc("2026-03-29T01:00:00"))  # 03:00 CEST
    assert not inside(Window(), rule, utc("2026-03-29T01:30:00"))  # 03:30 CEST


def test_daily_window_in_the_repeated_hour_opens_twice_on_fall_back_day() -> None:
    # 2026-10-25 in Berlin: 03:00 CEST is followed by 02:00 CET; 02:30 occurs at 00:30 and 01:30 UTC.
    rule = Rule(recurrence_type="daily", start_time="02:00", end_time="03:00")
    assert minutes_open(Window(), rule, date(2026, 10, 25)) == 120
    assert not inside(Window(), rule, utc("2026-10-24T23:59:59"))  # 01:59:59 CEST
    assert inside(Window(), rule, utc("2026-10-25T00:30:00"))  # 02:30 CEST
    assert inside(Window(), rule, utc("2026-10-25T01:30:00"))  # 02:30 CET
    assert not inside(Window(), rule, utc("2026-10-25T02:00:00"))  # 03:00 CET


def test_cron_start_in_the_skipped_hour_does_not_occur_and_in_the_repeated_hour_occurs_twice() -> None:
    rule = Rule(recurrence_type="cron", cron="30 2 * * *", duration_minutes=60)
    assert minutes_open(Window(), rule, date(2026, 3, 28)) == 60
    assert minutes_open(Window(), rule, date(2026, 3, 29)) == 0
    assert minutes_open(Window(), rule, date(2026, 10, 25)) == 120
    assert inside(Window(), rule, utc("2026-10-25T00:30:00"))  # 02:30 CEST
    assert inside(Window(), rule, utc("2026-10-25T02:29:59"))  # 03:29:59 CET, an hour after 02:30 CET


def test_frequent_cron_rule_counts_elapsed_time_across_the_repeated_hour() -> None:
    rule = Rule(recurrence_type="cron", cron="*/15 * * * *", duration_minutes=10)
    assert inside(Window(), rule, utc("2026-10-25T01:05:00"))  # 02:05 CET, five minutes after the second 02:00
    assert not inside(Window(), rule, utc("2026-10-25T01:12:00"))
    assert inside(Window(), rule, utc("2026-10-25T00:50:00"))  # 02:50 CEST
    assert minutes_open(Window(), rule, date(2026, 10, 25)) == 25 * 4 * 10
    assert minutes_open(Window(), rule, date(2026, 3, 29)) == 23 * 4 * 10


def test_rrule_durations_are_elapsed_time_across_a_clock_change() -> None:
    rule = Rule(recurrence_type="rrule", rrule="DTSTART:20260101T013000\nRRULE:FREQ=DAILY", duration_minutes=90)
    # 01:30 CET on spring-forward day is 00:30 UTC; ninety minutes later the clock shows 04:00 CEST.
    assert inside(Window(), rule, utc("2026-03-29T01:59:59"))
    assert not inside(Window(), rule, utc("2026-03-29T02:00:00"))
    assert minutes_open(Window(), rule, date(2026, 3, 29)) == 90


def test_new_york_changes_its_clock_on_its_own_dates() -> None:
    window = Window(timezone="America/New_York")
    two_to_three = Rule(recurrence_type="daily", start_time="02:00", end_time="03:00")
    one_to_two = Rule(recurrence_type="daily", start_time="01:00", end_time="02:00")
    assert minutes_open(window, two_to_three, date(2026, 3, 8)) == 0  # 02:00 EST is followed by 03:00 EDT
    assert minutes_open(window, two_to_three, date(2026, 3, 29)) == 60  # Berlin's change does not count here
    # On 1 November 02:00 EDT is followed by 01:00 EST: the repeated hour is 01:00-02:00.
    assert minutes_open(window, two_to_three, date(2026, 11, 1)) == 60
    assert minutes_open(window, one_to_two, date(2026, 11, 1)) == 120
    assert inside(window, one_to_two, utc("2026-11-01T05:30:00"))  # 01:30 EDT
    assert inside(window, one_to_two, utc("2026-11-01T06:30:00"))  # 01:30 EST
    assert not inside(window, one_to_two, utc("2026-11-01T07:00:00"))  # 02:00 EST


def test_naive_moments_are_read_on_the_window_clock() -> None:
    assert local_moment(datetime(2026, 7, 1, 12, 0), BERLIN).isoformat() == "2026-07-01T12:00:00+02:00"
    assert local_moment(utc("2026-07-01T12:00:00"), NEW_YORK).isoformat() == "2026-07-01T08:00:00-04:00"
    # In the skipped hour, the offset before the change applies; in the repeated hour, the first occurrence.
    assert local_moment(datetime(2026, 3, 29, 2, 30), BERLIN).isoformat() == "2026-03-29T03:30:00+02:00"
    assert local_moment(datetime(2026, 10, 25, 2, 30), BERLIN).isoformat() == "2026-10-25T02:30:00+02:00"
    rule = Rule(recurrence_type="daily", start_time="02:00", end_time="03:00")
    assert not inside(Window(), rule, datetime(2026, 3, 29, 2, 30))
    assert inside(Window(), rule, datetime(2026, 10, 25, 2, 30))


# The window around its rules


def test_inactive_window_is_never_inside() -> None:
    rule = Rule(recurrence_type="daily", start_time="00:00", end_time="00:00")
    verdict = window_contains(Window(status="inactive"), [rule], berlin(2026, 6, 1, 12, 0))
    assert verdict == (False, None, "window is inactive")


def test_validity_period_bounds_the_window_inclusively() -> None:
    window = Window(valid_from=berlin(2026, 6, 1, 0, 0), valid_until=berlin(2026, 6, 30, 12, 0))
    rule = Rule(id=7, recurrence_type="daily", start_time="00:00", end_time="00:00")
    before = window_contains(window, [rule], berlin(2026, 5, 31, 23, 59, 59))
    assert before == (False, None, "before valid_from 2026-06-01T00:00:00+02:00")
    assert window_contains(window, [rule], berlin(2026, 6, 1, 0, 0)) == (True, 7, None)
    assert window_contains(window, [rule], utc("2026-06-30T10:00:00")) == (True, 7, None)
    after = window_contains(window, [rule], utc("2026-06-30T10:00:01"))
    assert after == (False, None, "after valid_until 2026-06-30T12:00:00+02:00")


def test_window_without_rules_or_without_a_covering_rule_says_so() -> None:
    assert window_contains(Window(), [], berlin(2026, 6, 1, 12, 0)) == (False, None, "window has no rules")
    rule = Rule(recurrence_type="daily", start_time="02:00", end_time="03:00")
    verdict = window_contains(Window(), [rule], berlin(2026, 6, 1, 12, 0))
    assert verdict == (False, None, "no rule of the window covers this moment")


def test_first_matching_rule_by_id_wins() -> None:
    rules = [
        Rule(id=9, recurrence_type="daily", start_time="01:00", end_time="05:00"),
        Rule(id=4, recurrence_type="daily", start_time="02:00", end_time="03:00"),
        Rule(id=2, recurrence_type="weekly", day_of_week=3, start_time="00:00", end_time="00:00"),
    ]
    assert window_contains(Window(), rules, berlin(2026, 6, 1, 2, 30)).matched_rule_id == 4  # Monday
    assert window_contains(Window(), rules, berlin(2026, 6, 4, 2, 30)).matched_rule_id == 2  # Thursday
    assert window_contains(Window(), rules, berlin(2026, 6, 1, 4, 30)).matched_rule_id == 9


# What makes a schedule


@pytest.mark.parametrize(
    "rule, field, message",
    [
        (Rule(start_at=berlin(2026, 1, 1, 0, 0)), "end_at", "required for one-time rules"),
        (Rule(start_at=berlin(2026, 1, 2, 0, 0), end_at=berlin(2026, 1, 1, 0, 0)), "end_at", "after start_at"),
        (Rule(start_at=berlin(2026, 1, 1, 0, 0), end_at=berlin(2026, 1, 1, 0, 0)), "end_at", "after start_at"),
        (
            Rule(start_at=berlin(2026, 1, 1), end_at=berlin(2026, 1, 2), start_time="01:00", end_time="02:00"),
            "start_time",
            "does not apply to one-time rules",
        ),
        (Rule(recurrence_type="daily", start_time="01:00"), "end_time", "required for daily rules"),
        (
            Rule(recurrence_type="daily", start_time="01:00", end_time="02:00", day_of_week=1),
            "day_of_week",
            "does not apply to daily rules",
        ),
        (Rule(recurrence_type="weekly", start_time="01:00", end_time="02:00"), "day_of_week", "required"),
        (Rule(recurrence_type="monthly", start_time="01:00"), "day_of_month", "required for monthly rules"),
        (Rule(recurrence_type="monthly", day_of_month=3, start_time="01:00"), "end_time", "together"),
        (Rule(recurrence_type="monthly", day_of_month=3, end_time="01:00"), "start_time", "together"),
        (Rule(recurrence_type="cron"), "cron", "required for cron rules"),
        (Rule(recurrence_type="cron", cron="0 2 * * *", interval_count=2), "interval_count", "does not apply"),
        (Rule(recurrence_type="rrule", duration_minutes=30), "rrule", "required for rrule rules"),
        (
            Rule(recurrence_type="rrule", rrule="FREQ=DAILY", start_time="01:00", end_time="02:00", duration_minutes=5),
            "duration_minutes",
            "does not apply when start_time and end_time are given",
        ),
        (
            Rule(recurrence_type="weekly", day_of_week=1, start_time="01:00", end_time="02:00", duration_minutes=5),
            "duration_minutes",
            "does not apply to weekly rules",
        ),
    ],
)
def test_incomplete_or_contradictory_rules_name_the_field(rule: Rule, field: str, message: str) -> None:
    with pytest.raises(ScheduleError) as caught:
        check_rule(rule)
    assert caught.value.field == field
    assert message in caught.value.message


@pytest.mark.parametrize(
    "rule",
    [
        Rule(start_at=berlin(2026, 1, 1, 0, 0), end_at=berlin(2026, 1, 1, 0, 1)),
        Rule(recurrence_type="daily", start_time="22:00", end_time="02:00", interval_count=2),
        Rule(recurrence_type="weekly", day_of_week=6, start_time="01:00", end_time="02:00"),
        Rule(recurrence_type="monthly", day_of_month=31),
        Rule(recurrence_type="cron", cron="@daily", duration_minutes=15),
        Rule(recurrence_type="rrule", rrule="FREQ=DAILY", start_time="01:00", end_time="02:00"),
        Rule(recurrence_type="rrule", rrule="FREQ=DAILY", duration_minutes=20),
    ],
)
def test_complete_rules_pass(rule: Rule) -> None:
    check_rule(rule)


def test_validity_must_run_forwards() -> None:
    check_window(Window(valid_from=berlin(2026, 1, 1, 0, 0), valid_until=berlin(2026, 1, 1, 0, 0)))
    with pytest.raises(ScheduleError) as caught:
        check_window(Window(valid_from=berlin(2026, 1, 2, 0, 0), valid_until=berlin(2026, 1, 1, 0, 0)))
    assert str(caught.value) == "valid_until: must not be before valid_from"


@pytest.mark.parametrize("text", ["00:00", "23:59", "07:05:30"])
def test_times_of_day_accepted(text: str) -> None:
    assert check_time_of_day(text) == text


@pytest.mark.parametrize("text", ["24:00", "7:05", "12:60", "12:00:60", "12", "noon", "12:00:00.5", " 12:00"])
def test_times_of_day_refused(text: str) -> None:
    with pytest.raises(ValueError, match="HH:MM"):
        check_time_of_day(text)


def test_time_zones_must_be_iana_names() -> None:
    assert zone_named("America/New_York") == NEW_YORK
    assert zone_named("UTC") == ZoneInfo("UTC")
    for name in ("Mars/Olympus_Mons", "europe/berlin", "localtime", "../etc/passwd", "", "+01:00"):
        with pytest.raises(ValueError, match="unknown IANA time zone"):
            zone_named(name)


@pytest.mark.parametrize(
    "expression, message",
    [
        ("0 2 * * * *", "five fields"),
        ("0 2 * *", "five fields"),
        ("61 * * * *", "invalid cron expression"),
        ("0 2 * * 8", "invalid cron expression"),
        ("H 2 * * *", "invalid cron expression"),
        ("@reboot", "invalid cron expression"),
        ("0 0 30 2 *", "never matches"),
    ],
)
def test_bad_cron_expressions(expression: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_cron(expression)


@pytest.mark.parametrize(
    "text, message",
    [
        ("FREQ=HOURLY", "finer than daily"),
        ("RRULE:FREQ=MINUTELY;INTERVAL=5", "finer than daily"),
        ("FREQ=FORTNIGHTLY", "invalid RRULE"),
        ("FREQ=DAILY;BYDAY=XX", "invalid RRULE"),
        ("FREQ=DAILY;BYHOUR=25", "invalid RRULE"),
        ("not an rrule", "invalid RRULE"),
        ("DTSTART:20260101T020000Z\nRRULE:FREQ=DAILY", "must be local times"),
        ("FREQ=DAILY;UNTIL=20260301T000000Z", "UNTIL must be a local time"),
        ("FREQ=YEARLY;BYMONTH=2;BYMONTHDAY=30", "no occurrences"),
        ("FREQ=YEARLY;BYEASTER=400", "BYEASTER must be within a year of Easter"),
        # Never on a 29 February: 2025 + 4n is never a leap year. The RDATE alone would occur; the line is refused,
        # as dateutil would search it up to the year 9999 on every check of the window.
        (
            "DTSTART:20250101T010000\nRDATE:20260606T013000\nRRULE:FREQ=YEARLY;INTERVAL=4;BYMONTH=2;BYMONTHDAY=29",
            "RRULE:FREQ=YEARLY;INTERVAL=4;BYMONTH=2;BYMONTHDAY=29 has no occurrences: remove it",
        ),
    ],
)
def test_bad_rrules(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_rrule(text)


def test_good_rrules_are_kept_as_written() -> None:
    for text in ("FREQ=WEEKLY;BYDAY=MO,TH", "DTSTART:20260101T020000\nRRULE:FREQ=MONTHLY;BYMONTHDAY=-1"):
        assert check_rrule(text) == text


# Days the calendar never has: dateutil alone looks for them up to the year 9999, seconds for a daily rule.
@pytest.mark.parametrize(
    "text",
    [
        "FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30",
        "FREQ=WEEKLY;BYMONTH=4,6;BYMONTHDAY=31",
        "FREQ=DAILY;BYYEARDAY=366;BYMONTH=1",
        "FREQ=YEARLY;BYWEEKNO=53;BYMONTH=6",
        "FREQ=MONTHLY;BYDAY=6MO",
        "DTSTART:20000131T000000\nRRULE:FREQ=MONTHLY;BYMONTH=2",
        "RRULE:FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30\nRRULE:FREQ=YEARLY;BYMONTH=11;BYMONTHDAY=31",
    ],
)
def test_rrules_that_can_never_occur_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="the RRULE has no occurrences"):
        check_rrule(text)


@pytest.mark.parametrize(
    "text",
    [
        "FREQ=DAILY;BYMONTH=2;BYMONTHDAY=29;BYDAY=MO",  # 2016, 2044, ...
        "FREQ=DAILY;BYYEARDAY=366",
        "FREQ=YEARLY;BYWEEKNO=53",
        "FREQ=YEARLY;BYMONTH=2;BYDAY=5SU",
        "FREQ=DAILY;BYDAY=5MO;BYMONTH=2",  # a daily rule's BYDAY ordinal is ignored: every Monday in February
        "DTSTART:20000131T000000\nRRULE:FREQ=MONTHLY;BYMONTH=3",
    ],
)
def test_rare_rrules_that_do_occur_are_kept(text: str) -> None:
    assert check_rrule(text) == text


def test_an_rrule_that_can_never_occur_leaves_the_rdates_beside_it() -> None:
    rule = Rule(
        recurrence_type="rrule",
        rrule="RDATE:20260606T013000\nRRULE:FREQ=DAILY;BYMONTH=2;BYMONTHDAY=30",
        duration_minutes=45,
    )
    assert check_rrule(rule.rrule) == rule.rrule
    assert inside(Window(), rule, berlin(2026, 6, 6, 1, 40))
    assert not inside(Window(), rule, berlin(2026, 6, 7, 1, 40))


def test_an_exrule_that_can_never_occur_excludes_nothing() -> None:
    rule = Rule(
        recurrence_type="rrule",
        rrule="RRULE:FREQ=DAILY\nEXRULE:FREQ=DAILY;BYMONTH=4;BYMONTHDAY=31",
        start_time="01:00",
        end_time="02:00",
    )
    assert inside(Window(), rule, berlin(2026, 4, 30, 1, 30))
    assert not inside(Window(), rule, berlin(2026, 4, 30, 2, 30))


# Where a suppression starts and ends (certlm.lifecycle.suppression): the rule's own times, whatever moment asks.


def calendar_of(window: Window, *rules: Rule) -> MaintenanceCalendar:
    return MaintenanceCalendar([(window, list(rules))])  # type: ignore[list-item]


@pytest.mark.parametrize("asked_at", ["12:00:00.170291", "12:00:00.477607", "12:03:59.999999", "12:04:00"])
def test_a_suppression_starts_and_ends_at_the_rules_own_times_whoever_asks(asked_at: str) -> None:
    now = datetime.fromisoformat(f"2026-10-24T{asked_at}+00:00")
    # From 19:42 CEST (17:42Z) to 03:30 CET (02:30Z), across the night the Berlin clock goes back.
    rule = Rule(1, start_at=berlin(2026, 10, 24, 19, 42), end_at=datetime(2026, 10, 25, 2, 30, tzinfo=UTC))
    plant = calendar_of(Window(1, "Shutdown"), rule)
    coming = plant.next_suppression(now, timedelta(days=1))
    assert coming is not None
    assert (coming.start, coming.end) == (datetime(2026, 10, 24, 17, 42, tzinfo=UTC), rule.end_at)
    during = plant.suppression_at(coming.start + timedelta(hours=3, microseconds=123))
    assert during is not None and during.end == rule.end_at


def test_a_nightly_suppression_ends_on_the_wall_clock_second_across_the_spring_change() -> None:
    # Berlin, 29 March 2026: 01:00:30 CET until 04:15:45 CEST, two hours and a quarter of real time.
    rule = Rule(1, recurrence_type="daily", start_time="01:00:30", end_time="04:15:45")
    nightly = calendar_of(Window(1, "Night"), rule)
    coming = nightly.next_suppression(datetime(2026, 3, 28, 23, 10, 0, 314159, tzinfo=UTC), timedelta(hours=2))
    assert coming is not None
    assert coming.start == berlin(2026, 3, 29, 1, 0, 30).astimezone(UTC)
    assert coming.end == berlin(2026, 3, 29, 4, 15, 45).astimezone(UTC)
