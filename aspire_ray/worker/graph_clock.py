"""The GPU's timeline of CUDA graph replays, without the profiler (benchmarks, diagnosis).

The question it answers: where does the GPU sit idle in a decode phase whose steps are all
graph replays, and at which point of a plan (inside a run, or where one plan's steps end and
the next plan's begin)? The profiler answers it too, but slows the host it is asked about and
may drop events in long windows. Here each replay is bracketed by two timing events on its
stream (~2 us of GPU time each); ``collect`` reads them once, after one sync, as intervals on
the GPU's clock (``scripts/floor_report.clock_summary`` makes the report of them). Between two
replays the GPU either idled or ran the few small kernels a plan issues outside its graphs
(uploads, copies of the tokens): both count as the gap.

Callers name the phase their replays belong to (``phase("async:continue")``), so a gap is
known by the phases on its two sides: "async:early -> async:continue" is the plan boundary
of an asynchronous run that the next plan continued.

The host marks moments of its own (``mark("async:woke")``: its wait for a plan's tokens
returned); each is placed on the GPU's clock (one calibration at ``collect``, ~10 us) and told
as the GPU work queued at that moment: the replays launched before it, less the time already
run. Negative: the GPU had run dry that long before. At "async:woke", with the next run's
steps started early, the queued work should be those steps; at "async:launch" (the next plan
about to launch its steps) it is what the host's planning left of them.

The host's own time in each ``replay`` call is kept too: a launch returns in tens of
microseconds unless the stream's launch queue is full, when it blocks until the GPU has drained
enough of it (the host then runs in lock-step with the GPU, however early it launched).

One clock per process (a shard's), off until ``start``; replays cost one branch while it is off.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

MAX_REPLAYS = 50_000  # events beyond this many replays are not recorded (memory)


class GraphClock:
    def __init__(self) -> None:
        self.enabled = False
        self._phase = "other"
        # (begin, end, phase, host seconds in the replay call, the graph's step kind, its
        # step's shape or None: (verify rows, live rows, tokens) of an asynchronous step)
        self._marks: list[tuple] = []
        # (perf_counter s, name, replays launched before, replays the host waited for or -1)
        self._host: list[tuple[float, str, int, int]] = []
        self.dropped = 0  # replays past MAX_REPLAYS

    def start(self) -> None:
        """Record from now on (CUDA only; forgets what was recorded before)."""
        self._marks, self._host, self.dropped = [], [], 0
        self.enabled = torch.cuda.is_available()

    @property
    def launched(self) -> int:
        """Replays recorded so far (``mark``'s waited_for)."""
        return len(self._marks)

    def mark(self, name: str, waited_for: int = -1) -> None:
        """The host is at ``name`` now (``summarize``'s "host"). waited_for: where the host
        has just waited for the first so many replays (``launched`` when it queued the wait):
        the mark then also tells how long after the last of them ended the host woke."""
        if self.enabled and len(self._marks) < MAX_REPLAYS:
            self._host.append((time.perf_counter(), name, len(self._marks), waited_for))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Replays inside belong to ``name``."""
        outer, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = outer

    def replay(self, graph, kind: str = "other", shape: tuple | None = None) -> None:
        """graph.replay(), bracketed by timing events while the clock runs; kind: the step
        kind the graph holds ("draft", "verify", "async", "decode", "step", "piece"); shape:
        what its step held, (verify rows, live rows, tokens), where the caller knows."""
        if not self.enabled:
            graph.replay()
            return
        if len(self._marks) >= MAX_REPLAYS:
            self.dropped += 1
            graph.replay()
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        t0 = time.perf_counter()
        graph.replay()
        launch = time.perf_counter() - t0
        end.record()
        self._marks.append((begin, end, self._phase, launch, kind, shape))

    def collect(self) -> dict:
        """Stop; one device sync -> {"intervals": each replay as (begin ms, end ms, phase) in
        launch order, "launch_ms": the host's ms in each replay call, "kinds": each replay's
        step kind, "host": each mark as (ms on the same clock, name, replays launched before
        it, replays waited for or -1), "shapes": each replay's shape or None, "dropped":
        replays not recorded}."""
        marks, host, self._marks, self._host = self._marks, self._host, [], []
        self.enabled = False
        if not marks:
            return {"intervals": [], "launch_ms": [], "kinds": [], "host": [], "shapes": [],
                    "dropped": self.dropped}  # fmt: skip
        torch.cuda.synchronize()
        origin = marks[0][0]
        intervals = [(origin.elapsed_time(b), origin.elapsed_time(e), phase)
                     for b, e, phase, *_ in marks]  # fmt: skip
        # the host's clock on the GPU's: an event recorded on an idle GPU runs at once
        probe = torch.cuda.Event(enable_timing=True)
        now = time.perf_counter()
        probe.record()
        probe.synchronize()
        offset = 1e3 * now - origin.elapsed_time(probe)  # host ms - GPU ms
        at = [(1e3 * t - offset, name, before, waited) for t, name, before, waited in host]
        return {"intervals": intervals, "launch_ms": [1e3 * m[3] for m in marks],
                "kinds": [m[4] for m in marks], "host": at, "shapes": [m[5] for m in marks],
                "dropped": self.dropped}


CLOCK = GraphClock()  # this process's
