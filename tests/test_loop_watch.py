"""The event loop watchdog: it sees the loop held, and certlm's ``GET /metrics`` shows what it saw."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from certlm.foundation.config import Settings
from certlm.foundation.loop_watch import DEFAULT_TICK_S, LoopWatch
from tests.support import LicenseKeys, eventually, in_process_settings, licensed_app_in_process


async def ticked(watch: LoopWatch, beyond: int) -> None:
    async def has_ticked() -> bool:
        return watch.ticks > beyond

    await eventually(has_ticked, "tick of the loop watch", timeout=10)


async def test_a_held_loop_is_seen_as_a_stall_of_about_that_long() -> None:
    delays: list[float] = []
    watch = LoopWatch(delays.append)
    await watch.start()
    try:
        await ticked(watch, 0)
        ticks = watch.ticks
        time.sleep(0.2)  # the stall to measure: the loop runs nothing else meanwhile
        await ticked(watch, ticks)
    finally:
        await watch.stop()
    # The watch's timer was due at most one tick into the stall.
    assert 0.2 - watch.tick_s <= watch.longest_s
    assert max(delays) == watch.longest_s
    assert watch.reset_longest() == max(delays)
    assert watch.longest_s == 0


async def test_a_stopped_watch_observes_nothing_more() -> None:
    stopped, running = LoopWatch(), LoopWatch()
    await stopped.start()
    await running.start()
    try:
        await ticked(stopped, 0)
        await stopped.stop()
        ticks = stopped.ticks
        # The watch still running as the clock: several of its ticks later, the stopped one has not ticked again.
        await ticked(running, running.ticks + 5)
        assert stopped.ticks == ticks
    finally:
        await running.stop()
        await stopped.stop()


async def stall_samples(client, headers: dict[str, str]) -> dict[str, float]:
    response = await client.get("/metrics", headers=headers)
    assert response.status_code == 200
    text = await response.get_data(as_text=True)
    return {
        sample.name + str(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("certlm_event_loop")
        for sample in family.samples
    }


# The stall the metrics test causes, and the histogram bucket it overflows.
STALL_S = 0.6
BELOW_STALL = "certlm_event_loop_stall_seconds_bucket[('le', '0.5')]"
COUNT = "certlm_event_loop_stall_seconds_count[]"
LONGEST = "certlm_event_loop_longest_stall_seconds[]"


@pytest.mark.parametrize("switched_on", [True, False])
async def test_metrics_show_the_loop_stalls_unless_the_watch_is_switched_off(
    tmp_path, license_keys: LicenseKeys, switched_on: bool
) -> None:
    settings = in_process_settings(tmp_path, license_keys, loop_watch=switched_on)
    async with licensed_app_in_process(settings, license_keys) as (client, headers, _):

        async def watching() -> dict[str, float] | None:
            samples = await stall_samples(client, headers)
            return samples if samples[COUNT] > 0 else None

        if switched_on:
            before = await eventually(watching, "the watch's first observation", timeout=10)
            # The app runs on this test's loop: holding it here holds certlm.
            hold_the_loop_for(STALL_S)

            async def stall_seen() -> dict[str, float] | None:
                samples = await stall_samples(client, headers)
                longer = samples[COUNT] - samples[BELOW_STALL]
                return samples if longer > before[COUNT] - before[BELOW_STALL] else None

            samples = await eventually(stall_seen, "the stall in the metrics", timeout=10)
            # The watch's timer was due at most one tick into the stall.
            assert samples[LONGEST] >= STALL_S - DEFAULT_TICK_S
        else:
            # Requests run, time passes and the loop is held; nothing is watching it.
            await asyncio.gather(*(client.get("/systeminfo", headers=headers) for _ in range(5)))
            hold_the_loop_for(STALL_S)
            samples = await stall_samples(client, headers)
            assert (samples[COUNT], samples[LONGEST]) == (0, 0)


@pytest.mark.parametrize("value, expected", [("off", False), ("0", False), ("ON", True), ("", True)])
def test_the_watch_is_switched_with_certlm_loop_watch(value: str, expected: bool) -> None:
    assert Settings.from_env({"CERTLM_LOOP_WATCH": value}).loop_watch is expected


def test_a_loop_watch_setting_that_is_neither_on_nor_off_stops_the_start() -> None:
    with pytest.raises(ValueError, match="CERTLM_LOOP_WATCH must be on or off"):
        Settings.from_env({"CERTLM_LOOP_WATCH": "sometimes"})


async def test_a_traced_watch_logs_the_stack_that_held_the_loop(caplog: pytest.LogCaptureFixture) -> None:
    watch = LoopWatch(tick_s=0.01, trace_after_s=0.05)
    await watch.start()
    try:
        await ticked(watch, 0)
        ticks = watch.ticks
        with caplog.at_level("WARNING", logger="certlm.foundation.loop_watch"):
            hold_the_loop_for(0.3)
            await ticked(watch, ticks)
    finally:
        await watch.stop()
    traces = [record.getMessage() for record in caplog.records if "event loop held" in record.getMessage()]
    assert len(traces) == watch.traces
    # One trace per stall: the hold is traced once (on a loaded machine the process may also wait for a CPU,
    # which is traced as such).
    held = [trace for trace in traces if "hold_the_loop_for" in trace]
    assert len(held) == 1 and "time.sleep(seconds)" in held[0], traces


def hold_the_loop_for(seconds: float) -> None:
    time.sleep(seconds)


def test_the_trace_threshold_is_a_whole_number_of_milliseconds() -> None:
    assert Settings.from_env({"CERTLM_LOOP_TRACE_MS": "50"}).loop_trace_ms == 50
    assert Settings.from_env({}).loop_trace_ms is None
    for bad in ("0", "-5", "0.05", "fifty", "60001"):
        with pytest.raises(ValueError, match="CERTLM_LOOP_TRACE_MS must be a whole number from 1 to 60000"):
            Settings.from_env({"CERTLM_LOOP_TRACE_MS": bad})
