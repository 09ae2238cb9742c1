"""The GPU's timeline of CUDA graph replays, without the profiler (benchmarks, diagnosis).

The question it answers: where does the GPU sit idle in a decode phase whose steps are all
graph replays, and at which point of a plan (inside a run, or where one plan's steps end and
the next plan's begin)? The profiler answers it too, but slows the host it is asked about and
may drop events in long windows. Here each replay is bracketed by two timing events on its
stream (~2 us of GPU time each); ``collect`` reads them once, after one sync, as intervals on
the GPU's clock. Between two replays the GPU either idled or ran the few small kernels a plan
issues outside its graphs (uploads, copies of the tokens): both count as the gap.

Callers name the phase their replays belong to (``phase("async:continue")``), so a gap is
known by the phases on its two sides: "async:early -> async:continue" is the plan boundary
of an asynchronous run that the next plan continued.

The host marks moments of its own (``mark("async:woke")``: its wait for a plan's tokens
returned); each is placed on the GPU's clock (one calibration at ``collect``, ~10 us) and told
as the GPU work queued at that moment: the replays launched before it, less the time already
run. Negative: the GPU had run dry that long before. At "async:woke", with the next run's
steps started early, the queued work should be those steps; at "async:launch" (the next plan
about to launch its steps) it is what the host's planning left of them.

One clock per process (a shard's), off until ``start``; replays cost one branch while it is off.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence

import torch

# gap buckets by upper bound in ms (None: longer)
GAP_BUCKETS: tuple[float | None, ...] = (0.01, 0.1, 1.0, None)
MAX_REPLAYS = 50_000  # events beyond this many replays are not recorded (memory)


class GraphClock:
    def __init__(self) -> None:
        self.enabled = False
        self._phase = "other"
        self._marks: list[tuple[torch.cuda.Event, torch.cuda.Event, str]] = []
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

    def replay(self, graph) -> None:
        """graph.replay(), bracketed by timing events while the clock runs."""
        if not self.enabled:
            graph.replay()
            return
        if len(self._marks) >= MAX_REPLAYS:
            self.dropped += 1
            graph.replay()
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        self._marks.append((begin, end, self._phase))

    def collect(self) -> dict:
        """Stop; one device sync; -> ``summarize`` of the recorded replays."""
        marks, host, self._marks, self._host = self._marks, self._host, [], []
        self.enabled = False
        if not marks:
            return summarize([]) | {"dropped": self.dropped}
        torch.cuda.synchronize()
        origin = marks[0][0]
        intervals = [(origin.elapsed_time(b), origin.elapsed_time(e), phase)
                     for b, e, phase in marks]  # fmt: skip
        # the host's clock on the GPU's: an event recorded on an idle GPU runs at once
        probe = torch.cuda.Event(enable_timing=True)
        now = time.perf_counter()
        probe.record()
        probe.synchronize()
        offset = 1e3 * now - origin.elapsed_time(probe)  # host ms - GPU ms
        at = [(1e3 * t - offset, name, before, waited) for t, name, before, waited in host]
        return summarize(intervals, at) | {"dropped": self.dropped}


def summarize(intervals: Sequence[tuple[float, float, str]],
              host: Sequence[tuple[float, str, int, int]] = (), longest: int = 8) -> dict:
    """Replays as (begin ms, end ms, phase), in launch order on one stream -> the GPU's busy
    time in replays and its gaps between them: in all, by bucket (``GAP_BUCKETS``), by the
    phases either side ("before -> after"), busy by phase, and the longest gaps. host: marks
    as (ms on the same clock, name, replays launched before it, replays waited for or -1) ->
    per name the GPU work queued at the mark and the wake latency (``queued_at``)."""
    busy = sum(e - b for b, e, _ in intervals)
    span = intervals[-1][1] - intervals[0][0] if intervals else 0.0
    buckets = [{"upto_ms": hi, "count": 0, "ms": 0.0} for hi in GAP_BUCKETS]
    between: dict[str, dict] = {}
    by_phase: dict[str, dict] = {}
    gaps = []
    for i, (b, e, phase) in enumerate(intervals):
        mine = by_phase.setdefault(phase, {"replays": 0, "busy_ms": 0.0})
        mine["replays"] += 1
        mine["busy_ms"] += e - b
        if i == 0:
            continue
        prev_end, prev_phase = intervals[i - 1][1], intervals[i - 1][2]
        gap = max(b - prev_end, 0.0)
        bucket = next(k for k in buckets if k["upto_ms"] is None or gap <= k["upto_ms"])
        bucket["count"] += 1
        bucket["ms"] += gap
        key = f"{prev_phase} -> {phase}"
        pair = between.setdefault(key, {"count": 0, "ms": 0.0, "max_ms": 0.0})
        pair["count"] += 1
        pair["ms"] += gap
        pair["max_ms"] = max(pair["max_ms"], gap)
        gaps.append((gap, i, key))
    gaps.sort(reverse=True)
    return {
        "replays": len(intervals), "span_ms": span, "busy_ms": busy,
        "gap_ms": span - busy if intervals else 0.0,
        "idle_frac": (span - busy) / span if span > 0 else 0.0,
        "gaps": buckets,
        "between": dict(sorted(between.items(), key=lambda kv: -kv[1]["ms"])),
        "by_phase": by_phase,
        "longest": [{"ms": g, "replay": i, "between": key} for g, i, key in gaps[:longest]],
        "host": queued_at(intervals, host),
    }


def queued_at(intervals: Sequence[tuple[float, float, str]],
              host: Sequence[tuple[float, str, int, int]]) -> dict:  # fmt: skip
    """Per mark name: count, and the median / min / max of the GPU work queued at the mark
    (ms): the end of the last replay launched before it, less the mark's time (negative: the
    GPU had been idle that long). Marks after a wait (waited_for > 0) also give the wake
    latency: the mark's time less the end of the last replay waited for (~0: the host woke
    as its tokens were ready; about the work queued after them: the wait outlasted it)."""
    queued: dict[str, list[float]] = {}
    latency: dict[str, list[float]] = {}
    for at, name, before, waited in host:
        if before > 0:
            queued.setdefault(name, []).append(intervals[before - 1][1] - at)
        if waited > 0:
            latency.setdefault(name, []).append(at - intervals[waited - 1][1])
    out = {}
    for name, q in queued.items():
        out[name] = {"count": len(q), "queued_ms_median": statistics.median(q),
                     "queued_ms_min": min(q), "queued_ms_max": max(q)}  # fmt: skip
        if name in latency:
            out[name]["wake_latency_ms_median"] = statistics.median(latency[name])
            out[name]["wake_latency_ms_max"] = max(latency[name])
    return out


CLOCK = GraphClock()  # this process's
