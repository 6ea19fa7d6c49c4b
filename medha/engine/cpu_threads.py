"""The engine's CPU threads, fitted to the cores other processes leave free.

One OpenMP thread per core is fastest on an idle machine, but with a busy neighbour process one
of the threads shares its core: every parallel region then waits for the descheduled thread,
and spinning threads take time from the neighbour and from each other (SmolLM2 on 2 cores: a
short chat 3.4x slower beside one spinning process, 1.0x with one thread). vLLM binds its model
to fewer cores than the machine has; medha measures instead: every `interval_s` it reads how
much CPU the whole machine used (/proc/stat) against its own process (process_time), and runs
on the cores left: all of them when the others use less than a third of a core, one fewer per
core they keep busy. Linux only; elsewhere, or with --threads given, the count stays fixed.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

log = logging.getLogger("medha.engine")


def machine_busy_s(path: str = "/proc/stat") -> float | None:
    """CPU seconds every core spent not idle since boot, or None where /proc/stat is not."""
    try:
        with open(path) as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(ticks) - ticks[3] - ticks[4]
    return busy / os.sysconf("SC_CLK_TCK")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class ThreadGovernor:
    """`max_threads`: the engine's thread count on an idle machine; `cores`: the cores it may
    run on. Other processes are measured machine-wide (on a machine with more cores than this
    process may use, work on the others counts against it too: it errs toward fewer threads)."""

    def __init__(
        self,
        max_threads: int,
        cores: int,
        interval_s: float = 1.0,
        machine: Callable[[], float | None] = machine_busy_s,
        own: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        set_threads: Callable[[int], None] | None = None,
        get_threads: Callable[[], int] | None = None,
    ) -> None:
        if set_threads is None:
            import torch

            set_threads, get_threads = torch.set_num_threads, torch.get_num_threads
        self.max_threads, self.cores, self.interval_s = max_threads, cores, interval_s
        self.threads = max_threads
        self._machine, self._own, self._clock, self._set = machine, own, clock, set_threads
        self._get = get_threads or (lambda: self.threads)
        self._last = self._sample()

    def _sample(self):
        return self._clock(), self._machine(), self._own()

    def others_cores(self) -> float | None:
        """Cores other processes kept busy since the last look (None: not measurable)."""
        now = self._sample()
        (t0, m0, o0), (t1, m1, o1) = self._last, now
        self._last = now
        if m0 is None or m1 is None or t1 <= t0:
            return None
        return max(0.0, ((m1 - m0) - (o1 - o0)) / (t1 - t0))

    def tick(self) -> int:
        """Called before each step; every interval_s, refits the thread count. Returns it."""
        if self._clock() - self._last[0] < self.interval_s:
            return self.threads
        others = self.others_cores()
        if others is None:
            return self.threads
        # a third of a core of background work (daemons, the client) leaves every core ours
        threads = max(1, min(self.max_threads, self.cores - math.ceil(others - 1 / 3)))
        # the process's count, not the one last set here: another engine in the process, a
        # worker group or a test harness may have set it since
        if threads != self._get():
            self._set(threads)
        if threads != self.threads:
            # said, so that a step log's slower steps can be told from a slower kernel
            log.info(
                "CPU threads %d -> %d: other processes kept %.2f cores busy",
                self.threads,
                threads,
                others,
            )
        self.threads = threads
        return self.threads
