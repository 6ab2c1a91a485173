"""A watchdog for the event loop: how late a periodic timer fires is how long the loop was kept from its callbacks.

Work that holds the loop (parsing, signing, a long search in plain Python) delays every request and timer of the
process. ``LoopWatch`` measures it from inside the process, cheaply enough to run in production: ``GET /metrics``
shows what it saw as ``certlm_event_loop_stall_seconds``. With ``trace_after_s`` it also says what held the loop: a
thread of its own logs the Python stack of the loop's thread whenever the loop has been held that long, which names
the code to move off the loop (``CERTLM_LOOP_TRACE_MS``).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

log = logging.getLogger(__name__)
# The innermost frames of a held loop's stack that a trace logs: enough to see the caller of the library code.
TRACE_FRAMES = 16
_SELECTOR_WAITS = frozenset({"select", "poll", "epoll"})

# The watchdog's tick. A stall shows up to one tick shorter than it was: 10 ms resolves the 50 ms that matter.
DEFAULT_TICK_S = 0.01


class LoopWatch:
    """Measures, every ``tick_s``, how much later than asked its timer fired, and reports each delay to ``observe``.

    ``longest_s`` is the longest delay seen since the start (or ``reset_longest``)."""

    def __init__(
        self,
        observe: Callable[[float], None] = lambda delay_s: None,
        tick_s: float = DEFAULT_TICK_S,
        trace_after_s: float | None = None,
    ) -> None:
        self.observe = observe
        self.tick_s = tick_s
        self.trace_after_s = trace_after_s
        self.longest_s = 0.0
        self.ticks = 0
        self.traces = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        # The pending tick: a timer callback, not a sleeping task, whose every tick cost a future, a task step and a
        # wake-up callback besides the timer (idle, on a loaded 2-core machine: 16-18 ms of CPU a second as a task,
        # 11-13 as a callback; the rest is the loop waking up 100 times a second).
        self._timer: asyncio.TimerHandle | None = None
        self._asked = 0.0  # when (the loop's clock) the pending tick was asked for
        self._tracer: threading.Thread | None = None
        self._stopping = threading.Event()
        # When the watch last ran on the loop (time.monotonic()); the tracer reads it from its own thread.
        self._beat = time.monotonic()

    async def start(self) -> None:
        """Start watching the running loop (a coroutine, so that Quart's ``before_serving`` runs it on the loop)."""
        if self._timer is None:
            self._loop = asyncio.get_running_loop()
            self._ask()
        if self.trace_after_s is not None and self._tracer is None:
            self._stopping.clear()
            loop_thread = threading.get_ident()
            self._tracer = threading.Thread(
                target=self._trace, args=(loop_thread,), name="certlm-loop-trace", daemon=True
            )
            self._tracer.start()

    async def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._tracer is not None:
            self._stopping.set()
            self._tracer.join()
            self._tracer = None

    def reset_longest(self) -> float:
        """The longest delay so far, and start counting afresh: what a test or benchmark phase saw."""
        longest, self.longest_s = self.longest_s, 0.0
        return longest

    def _ask(self) -> None:
        assert self._loop is not None
        self._beat = time.monotonic()
        self._asked = self._loop.time()
        self._timer = self._loop.call_at(self._asked + self.tick_s, self._tick)

    def _tick(self) -> None:
        assert self._loop is not None
        delay = max(0.0, self._loop.time() - self._asked - self.tick_s)
        self.ticks += 1
        self.longest_s = max(self.longest_s, delay)
        self.observe(delay)
        self._ask()

    def _trace(self, loop_thread: int) -> None:
        """Runs in its own thread: once per stall longer than ``trace_after_s``, logs where the loop's thread is.

        The stack is sampled while the loop is still held, so it shows the work holding it (or, for a full garbage
        collection, the allocation that started it). A C call that keeps the GIL delays the sample to its end."""
        assert self.trace_after_s is not None
        held_after = self.tick_s + self.trace_after_s
        traced_beat = None
        while not self._stopping.wait(self.tick_s):
            beat = self._beat
            held_s = time.monotonic() - beat
            if held_s < held_after or beat == traced_beat:
                continue
            traced_beat = beat
            frame = sys._current_frames().get(loop_thread)
            if frame is None:
                continue
            stack = "".join(traceback.format_stack(frame)[-TRACE_FRAMES:])
            # A loop found waiting in its selector was not held by certlm's code: the process waited for a CPU.
            waiting = (
                " (waiting for I/O: the process was not given a CPU)" if frame.f_code.co_name in _SELECTOR_WAITS else ""
            )
            self.traces += 1
            log.warning(
                "event loop held for over %.0f ms%s, in:\n%s", (held_s - self.tick_s) * 1000, waiting, stack.rstrip()
            )
