"""A watchdog for the event loop: how late a periodic timer fires is how long the loop was kept from its callbacks.

Work that holds the loop (parsing, signing, a long search in plain Python) delays every request and timer of the
process. ``LoopWatch`` measures it from inside the process, cheaply enough to run in production: ``GET /metrics``
shows what it saw as ``certlm_event_loop_stall_seconds``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# The watchdog's tick. A stall shows up to one tick shorter than it was: 10 ms resolves the 50 ms that matter.
DEFAULT_TICK_S = 0.01


class LoopWatch:
    """Measures, every ``tick_s``, how much later than asked its timer fired, and reports each delay to ``observe``.

    ``longest_s`` is the longest delay seen since the start (or ``reset_longest``)."""

    def __init__(self, observe: Callable[[float], None] = lambda delay_s: None, tick_s: float = DEFAULT_TICK_S) -> None:
        self.observe = observe
        self.tick_s = tick_s
        self.longest_s = 0.0
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start watching the running loop (a coroutine, so that Quart's ``before_serving`` runs it on the loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="certlm-loop-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def reset_longest(self) -> float:
        """The longest delay so far, and start counting afresh: what a test or benchmark phase saw."""
        longest, self.longest_s = self.longest_s, 0.0
        return longest

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            await asyncio.sleep(self.tick_s)
            delay = max(0.0, loop.time() - asked - self.tick_s)
            self.ticks += 1
            self.longest_s = max(self.longest_s, delay)
            self.observe(delay)
