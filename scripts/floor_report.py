"""The arithmetic and the table of scripts/bench_floor.py, in plain Python (tested without a
model or GPU).

What a decode step must read at least once from memory: every weight, and the KV pages each row
lists in each layer; and how long the GPU sat idle in a step (wall time minus its busy time).
"""

from __future__ import annotations

import gzip
import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
SPLIT = ("prepare", "forward", "refresh", "sample", "total")  # worker timings, seconds


class Row(NamedTuple):
    """One row of a step plan, as far as its reads go."""

    kind: str  # "draft", "verify" or "prefill"
    context_len: int  # tokens of KV the row attends to, its own inputs included
    num_tokens: int  # query tokens
    num_drafts: int = 0  # verify rows: d (0: a plain autoregressive step)
    num_steps: int = 1  # draft rows of a draft chain: its steps (bytes are per step)
    in_round: bool = False  # a chain and its verification in one plan (a "round")
    rounds: int = 1  # rounds of that plan (RowPlan.num_rounds; bytes are per round)
    run_step: int = -1  # step of an asynchronous run (RowPlan.async_gamma) the row is in; -1: none


def weight_bytes(shapes: Iterable[tuple[str, Sequence[int]]], n_tokens: int, elem: int) -> int:
    """Bytes of weights a step of n_tokens reads: every tensor once, but of the embedding table
    only the n_tokens gathered rows. The lm_head is read whole; a tied head IS the table, so
    then the table is read whole (as the head) and its gathered rows once more.

    shapes: (name, full shape) of every checkpoint tensor (model_loading.hf_weight_shapes).
    """
    total, hidden, tied_vocab = 0, None, None
    has_head = False
    for name, shape in shapes:
        if name == EMBED:
            tied_vocab, hidden = shape
            continue
        has_head |= name == HEAD
        total += math.prod(shape)
    if hidden is None:
        raise ValueError(f"no {EMBED} among the shapes")
    head = 0 if has_head else tied_vocab * hidden
    return (total + head + n_tokens * hidden) * elem


def page_bytes(page_size: int, kv_heads: int, head_dim: int, elem: int) -> int:
    """Bytes of one page in one layer: K and V of page_size tokens."""
    return 2 * page_size * kv_heads * head_dim * elem


def kv_page_reads(
    rows: Iterable[Row],
    num_layers: int,
    page_size: int,
    budget: Callable[[int], int],
    refresh_full: bool,
) -> int:
    """Pages read over all layers: a draft row reads its sparse list S_i (k_i = budget(P_i)
    pages, or all P_i pages when P_i <= k_i) in every layer, except the refresh layer of a
    scoring policy (refresh_full), where it reads all P_i; other rows read all P_i everywhere."""
    reads = 0
    for row in rows:
        pages = math.ceil(row.context_len / page_size)
        if row.kind != "draft":
            reads += num_layers * pages
            continue
        sparse = min(budget(pages), pages)
        reads += (num_layers - 1) * sparse + pages if refresh_full else num_layers * sparse
    return reads


def async_run_rows(context_len: int, kinds: Sequence[int]) -> list[Row]:
    """The rows of one request in an asynchronous run, a row per step (``RowPlan.async_kinds``:
    -1 drafts, d >= 0 verifies d drafts with d + 1 queries). The row's context is taken to grow
    by one token a step (an upper bound: a verification may commit fewer tokens than it had
    queries; within a run of 16 steps that is under 16 tokens of a long context)."""
    return [
        Row("draft", context_len + i, 1, run_step=i) if k < 0
        else Row("verify", context_len + i, k + 1, num_drafts=k, run_step=i)
        for i, k in enumerate(kinds)
    ]  # fmt: skip


def step_kind(rows: Sequence[Row]) -> str:
    """ar (verify rows with no drafts), draft, verify, mixed (draft + verify), prefill, round
    (a draft chain and its verification in one plan), async (the steps of an asynchronous
    run: ``aspire``'s rows, each drafting or verifying at its own pace)."""
    kinds = {r.kind for r in rows}
    if any(r.in_round for r in rows):
        return "round"
    if any(r.run_step >= 0 for r in rows):
        return "async"
    if "prefill" in kinds or not kinds:
        return "prefill"
    if kinds == {"draft"}:
        return "draft"
    if kinds == {"verify"}:
        return "ar" if all(r.num_drafts == 0 for r in rows) else "verify"
    return "mixed"


def busy_seconds(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of (start, end) intervals clipped to [lo, hi)."""
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi)
    busy, end = 0.0, lo
    for s, e in clipped:
        if e > end:
            busy += e - max(s, end)
            end = e
    return busy


GAP_BUCKETS_NS = (2_000, 10_000, 100_000)  # idle gaps up to 2 us, 10 us, 100 us, longer


def idle_gaps(intervals: Iterable[tuple[float, float]], lo: float, hi: float,
              buckets: Sequence[float] = GAP_BUCKETS_NS) -> list[tuple[int, float]]:
    """The idle time inside [lo, hi) as (count, total length) of its gaps per size bucket:
    gaps up to buckets[0], up to buckets[1], ..., longer. Between kernels of one CUDA graph
    the gaps are short (the GPU between nodes); a host stall leaves a long one."""
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi)
    out = [[0, 0.0] for _ in range(len(buckets) + 1)]
    end = lo
    for s, e in [*clipped, (hi, hi)]:
        if s > end:
            b = next((i for i, limit in enumerate(buckets) if s - end <= limit), len(buckets))
            out[b][0] += 1
            out[b][1] += s - end
        end = max(end, e)
    return [(n, t) for n, t in out]


def long_gaps(intervals: Iterable[tuple[float, float]], lo: float, hi: float,
              longer_than: float = GAP_BUCKETS_NS[-1]) -> list[tuple[float, float]]:
    """The idle stretches inside [lo, hi) longer than ``longer_than`` (ns) as (start, end):
    where the GPU waited for the host (``idle_gaps``' last bucket)."""
    clipped = sorted((max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi)
    out, end = [], lo
    for s, e in [*clipped, (hi, hi)]:
        if s - end > longer_than:
            out.append((end, s))
        end = max(end, e)
    return out


CLOCK_GAP_BUCKETS_MS = (0.01, 0.1, 1.0)  # the graph clock's gaps: <= 10 us, 100 us, 1 ms, longer


def replay_stats(ms: list[float]) -> dict:
    """A group of replays' GPU ms: count, total, mean and median a replay."""
    return {"replays": len(ms), "busy_ms": sum(ms), "mean_ms": sum(ms) / len(ms),
            "median_ms": statistics.median(ms)}  # fmt: skip


def by_kind(intervals: list, kinds: list[str] | None) -> dict:
    """GPU ms of each step kind's replays (the graph a replay ran: "draft", "verify",
    "async", "decode", ...): count, total, mean and median a replay. A draft step of the
    synchronized rounds is timed here as it runs in them, between the plan's other graphs,
    not alone (bench_floor's host-planned steps)."""
    if not kinds:
        return {}
    times: dict[str, list[float]] = {}
    for (b, e, _), kind in zip(intervals, kinds, strict=True):
        times.setdefault(kind, []).append(e - b)
    return {kind: replay_stats(ms) for kind, ms in sorted(times.items())}


def by_verify_share(intervals: list, kinds: list[str] | None, shapes: list | None) -> dict:
    """GPU ms of the replays whose step held verify rows, by the share of its live rows that
    verified (a quarter, a half, three quarters, all: "async_verify <=50%"): count, median
    and mean ms, and the mean verify rows, live rows and tokens of such a step. Whether a
    step where a few rows verify costs its rows' share of a full verification."""
    groups: dict[tuple[str, int], list[tuple[float, tuple]]] = {}
    for (b, e, _), kind, shape in zip(intervals, kinds or [], shapes or [], strict=False):
        if shape is None or not shape[0] or not shape[1]:
            continue
        share = 25 * -(-4 * shape[0] // shape[1])  # rounded up to a quarter
        groups.setdefault((kind, share), []).append((e - b, shape))
    out = {}
    for (kind, share), got in sorted(groups.items()):
        means = {f"mean_{name}": sum(sh[i] for _, sh in got) / len(got)
                 for i, name in enumerate(("verify_rows", "live_rows", "tokens"))}  # fmt: skip
        out[f"{kind} <={share}%"] = {**replay_stats([m for m, _ in got]), **means}
    return out


def clock_summary(raw: dict, longest: int = 8) -> dict:
    """The graph clock's record (``GraphClock.collect``: replays as (begin ms, end ms, phase)
    in launch order on one stream, host marks) -> the GPU's busy time in replays and its idle
    between them: in all, by size (``idle_gaps``' buckets), by the phases either side
    ("before -> after"), busy by phase (and the host's time in those replay calls, when
    recorded: ms past ~0.1 a launch say the launch queue was full), the longest gaps, and per
    host mark the work queued (``queued_at``); GPU ms by step kind (``by_kind``) and, for
    steps with verify rows, by the share of rows verifying (``by_verify_share``); and every
    replay in order (``replay_sequence``)."""
    intervals = raw["intervals"]
    launches = raw.get("launch_ms") or [None] * len(intervals)
    busy = sum(e - b for b, e, _ in intervals)
    span = intervals[-1][1] - intervals[0][0] if intervals else 0.0
    sized = idle_gaps([(b, e) for b, e, _ in intervals], intervals[0][0] if intervals else 0.0,
                      intervals[-1][1] if intervals else 0.0, CLOCK_GAP_BUCKETS_MS)
    between: dict[str, dict] = {}
    by_phase: dict[str, dict] = {}
    gaps = []
    for i, ((b, e, phase), launch) in enumerate(zip(intervals, launches, strict=True)):
        mine = by_phase.setdefault(phase, {"replays": 0, "busy_ms": 0.0})
        mine["replays"] += 1
        mine["busy_ms"] += e - b
        if launch is not None:
            mine["launch_host_ms"] = mine.get("launch_host_ms", 0.0) + launch
            mine["launch_host_max_ms"] = max(mine.get("launch_host_max_ms", 0.0), launch)
        if i:
            gap, key = max(b - intervals[i - 1][1], 0.0), f"{intervals[i - 1][2]} -> {phase}"
            pair = between.setdefault(key, {"count": 0, "ms": 0.0, "max_ms": 0.0})
            pair["count"] += 1
            pair["ms"] += gap
            pair["max_ms"] = max(pair["max_ms"], gap)
            gaps.append((gap, i, key))
    gaps.sort(reverse=True)
    return {
        "replays": len(intervals), "dropped": raw.get("dropped", 0), "span_ms": span,
        "by_kind": by_kind(intervals, raw.get("kinds")),
        "by_verify_share": by_verify_share(intervals, raw.get("kinds"), raw.get("shapes")),
        "busy_ms": busy, "gap_ms": span - busy, "idle_frac": (span - busy) / span if span else 0.0,
        "gaps": [{"upto_ms": hi, "count": n, "ms": t}
                 for hi, (n, t) in zip((*CLOCK_GAP_BUCKETS_MS, None), sized, strict=True)],
        "between": dict(sorted(between.items(), key=lambda kv: -kv[1]["ms"])),
        "by_phase": by_phase,
        "longest": [{"ms": g, "replay": i, "between": key} for g, i, key in gaps[:longest]],
        "host": queued_at(intervals, raw["host"]),
        "sequence": replay_sequence(intervals, raw.get("kinds"), raw.get("shapes")),
    }


def replay_sequence(intervals: list, kinds: list[str] | None, shapes: list | None,
                    most: int = 4096) -> list[list]:
    """Each replay in launch order (the first ``most``), for reading a window step by step
    offline: [begin ms from the first, GPU ms, phase, kind, shape (an asynchronous step's
    verify rows, live rows, tokens) or None]."""
    t0 = intervals[0][0] if intervals else 0.0
    kinds, shapes = kinds or [None] * len(intervals), shapes or [None] * len(intervals)
    return [[round(b - t0, 4), round(e - b, 4), phase, kind, list(shape) if shape else None]
            for (b, e, phase), kind, shape in zip(intervals[:most], kinds, shapes, strict=False)]


def queued_at(intervals: Sequence[tuple[float, float, str]],
              host: Sequence[tuple[float, str, int, int]]) -> dict:
    """Per host mark name: count, and the median / min / max of the GPU work queued at the
    mark (ms): the end of the last replay launched before it, less the mark's time (negative:
    the GPU had been idle that long). Marks after a wait (waited_for > 0) also give the wake
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


def host_at_gaps(gaps: Sequence[tuple[float, float]], spans: Iterable[tuple[float, float, str]],
                 every_ns: float = 10_000) -> dict[str, float]:
    """What the host was doing while the GPU sat idle: gaps (start, end) ns of an idle GPU,
    spans (start, end, name) ns of host work (Python functions, CUDA runtime calls, one
    thread) -> {name: ns}, each point every ``every_ns`` inside a gap charged to the innermost
    span holding it (the one that began last), or to "(none)"; sorted, largest first."""
    import bisect

    gaps = sorted(gaps)  # disjoint: their ends are sorted too
    ends = [g1 for _, g1 in gaps]

    def overlaps(sp) -> bool:  # the first gap ending after the span starts begins before its end
        i = bisect.bisect_right(ends, sp[0])
        return i < len(gaps) and gaps[i][0] < sp[1]

    near = sorted(sp for sp in spans if overlaps(sp))
    out: dict[str, float] = {}
    for g0, g1 in gaps:
        holding = [sp for sp in near if sp[0] < g1 and sp[1] > g0]
        t = g0 + every_ns / 2
        while t < g1:
            inside = [sp for sp in holding if sp[0] <= t < sp[1]]
            name = max(inside, key=lambda sp: (sp[0], -sp[1]))[2] if inside else "(none)"
            out[name] = out.get(name, 0.0) + every_ns
            t += every_ns
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def gap_borders(gaps: Sequence[tuple[float, float]],
                kernels: Sequence[tuple[float, float, str]]) -> dict[tuple[str, str], int]:
    """Which GPU work ends before each idle gap and which begins after it: gaps (start, end),
    kernels (start, end, name) -> {(name before, name after): gaps}, most first. Inside a
    step's graph both are the step's own kernels; at a step's edge, its last and the next
    one's first ("-" where none)."""
    import bisect

    by_end = sorted(kernels, key=lambda k: k[1])
    by_start = sorted(kernels)
    ends, starts = [k[1] for k in by_end], [k[0] for k in by_start]
    out: dict[tuple[str, str], int] = {}
    for g0, g1 in gaps:
        i, j = bisect.bisect_right(ends, g0) - 1, bisect.bisect_left(starts, g1)
        pair = (by_end[i][2] if i >= 0 else "-", by_start[j][2] if j < len(by_start) else "-")
        out[pair] = out.get(pair, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def idle_per_step(
    starts: Sequence[float], last_end: float, intervals: Sequence[tuple[float, float]]
) -> list[tuple[float, float]]:
    """(window, busy) per step: a step's window runs from its start to the next step's start
    (the last one's to last_end), so host time between steps counts as idle; GPU work that
    spills past a step's window counts in the next one."""
    bounds = [*starts, last_end]
    return [
        (hi - lo, busy_seconds(intervals, lo, hi))
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]


def median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def summarize(steps: list[dict], profile: list[dict] | None, bandwidth: float) -> dict:
    """Per step kind: medians of the timed steps, floor = bytes / bandwidth, ratio, GPU idle.

    steps: {"kind", "wall_s", "rows", "tokens", "bytes": {"weights", "kv", "total"},
            "worker_s": {name: seconds}} per timed step.
    profile: {"kind", "window_s", "busy_s"[, "idle_gaps"]} per profiled step, or None (CPU).
    bandwidth: bytes per second (read + write of a copy).
    Idle is the unprofiled median wall minus the profiled median GPU-busy time, because the
    profiler's own host overhead lengthens the profiled steps (their idle is kept apart).
    """
    kinds = {}
    for kind in dict.fromkeys(s["kind"] for s in steps):
        mine = [s for s in steps if s["kind"] == kind]
        wall = median(s["wall_s"] for s in mine)
        nbytes = {k: median(s["bytes"][k] for s in mine) for k in ("weights", "kv", "total")}
        floor = nbytes["total"] / bandwidth
        names = dict.fromkeys(n for s in mine for n in s["worker_s"])
        k = {
            "steps": sum(s.get("chain", 1) for s in mine),  # a draft chain counts its steps
            "wall_ms": 1e3 * wall,
            "rows": median(s["rows"] for s in mine),
            "tokens": median(s["tokens"] for s in mine),
            "bytes": nbytes,
            "floor_ms": 1e3 * floor,
            "ratio": wall / floor,
            "worker_ms": {
                n: 1e3 * median(s["worker_s"][n] for s in mine if n in s["worker_s"]) for n in names
            },
        }
        prof = [p for p in profile or [] if p["kind"] == kind]
        if prof:
            busy = median(p["busy_s"] for p in prof)
            k["gpu"] = {
                "profiled_steps": len(prof),
                "busy_ms": 1e3 * busy,
                "idle_ms": 1e3 * (wall - busy),
                "idle_frac": (wall - busy) / wall,
                "profiled_idle_ms": 1e3 * median(p["window_s"] - p["busy_s"] for p in prof),
            }
            gaps = [p["idle_gaps"] for p in prof if "idle_gaps" in p]
            if gaps:  # medians per bucket of the profiled steps' idle gaps (idle_gaps)
                limits = [ns / 1e3 for ns in GAP_BUCKETS_NS] + [None]  # us; None: longer
                k["gpu"]["idle_gaps"] = [
                    {"upto_us": limit, "count": median(g[b]["count"] for g in gaps),
                     "ms": median(g[b]["ms"] for g in gaps)}
                    for b, limit in enumerate(limits)]  # fmt: skip
        kinds[kind] = k
    return kinds


def table(results: list[dict], bw: dict) -> str:
    lines = [
        f"copy bandwidth {bw['bytes_per_s'] / 1e12:.3f} TB/s ({bw['counts']}; "
        f"{bw['copy_bytes'] / 2**20:.0f} MiB x {bw['repeats']}, median)",
        "",
        "| mode | step | n | wall ms | prepare / forward / refresh / sample ms | weights GB "
        "| KV GB | floor ms | ratio | GPU busy ms | idle ms (frac) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for kind, k in r["kinds"].items():
            w = k["worker_ms"]
            split = " / ".join(f"{w[x]:.2f}" if x in w else "-" for x in SPLIT[:-1])
            g = k.get("gpu")
            gpu = (
                f"{g['busy_ms']:.2f} | {g['idle_ms']:.2f} ({g['idle_frac']:.0%})" if g else "- | -"
            )
            lines.append(
                f"| {r['mode']} | {kind} | {k['steps']} | {k['wall_ms']:.2f} | {split} "
                f"| {k['bytes']['weights'] / 1e9:.3f} | {k['bytes']['kv'] / 1e9:.3f} "
                f"| {k['floor_ms']:.3f} | {k['ratio']:.2f}x | {gpu} |"
            )
    return "\n".join(lines)


# the graph clock's step kinds named as bench_floor's step kinds (`ar`'s chains replay "decode")
_CLOCK_KINDS = {"decode": "ar"}


def _gamma_mode(mode: str) -> tuple[str, int] | None:
    """A fixed-gamma mode's (base, gamma): "aspire_fixed/g7" -> ("aspire_fixed", 7),
    "magicdec/g5+serial" -> ("magicdec/serial", 5); None without a gN variant."""
    m = re.fullmatch(r"(.+)/(?:(.*)\+)?g(\d+)(?:\+(.*))?", mode)
    if m is None:
        return None
    return m[1] + "".join(f"/{p}" for p in (m[2], m[4]) if p), int(m[3])


def _slope_floors(results: list[dict]) -> dict[str, dict[str, float]]:
    """mode -> {"draft": ms, "verify": ms}: the floors of a round mode's draft step and of its
    verification, where the mode ran at two gammas (``draft_slopes``): the draft step's the
    slope's, the verification's its round's floor less gamma draft floors."""
    slopes = {s["mode"]: s["floor_ms"] for s in draft_slopes(results)}
    floors = {}
    for r in results:
        bg = _gamma_mode(r["mode"])
        if bg is not None and bg[0] in slopes and "round" in r["kinds"]:
            draft = slopes[bg[0]]
            floors[r["mode"]] = {"draft": draft,
                                 "verify": r["kinds"]["round"]["floor_ms"] - bg[1] * draft}
    return floors


def _batch_floor(step: dict, batch: int | None) -> tuple[float, str]:
    """A step kind's floor in ms for a graph of ``batch`` rows, with a note. A round mode's own
    draft and verify steps are the few a plan runs alone near the requests' ends, on fewer rows
    than the round's graphs replay; their KV bytes are a row's times its rows, so the graph's
    floor takes the weights once and the KV scaled to the batch."""
    rows, floor = step.get("rows"), step["floor_ms"]
    if not batch or not rows or rows >= batch or "bytes" not in step:
        return floor, ""
    b = step["bytes"]
    scaled = b["weights"] + b["kv"] * batch / rows
    return floor * scaled / b["total"], f" ({rows:g} rows to {batch})"


def graph_kind_rows(results: list[dict], batch: int | None = None) -> list[dict]:
    """Per mode and graph kind: replays, GPU ms a replay on the graph clock (``by_kind``: the
    steps as they run in their plans, rounds and runs, unprofiled; median and mean) and the
    floor of bench_floor's step kind of that name, where the mode timed one (its bytes /
    bandwidth, its KV scaled to ``batch`` rows where the step kind ran on fewer:
    ``_batch_floor``; None where none), with the floor's note; a round mode's draft and verify
    graphs, where it ran at two gammas, against ``_slope_floors``'."""
    rows = []
    slope_floors = _slope_floors(results)
    for r in results:
        for kind, g in r.get("graph_kinds", {}).items():
            # a round mode's draft and verify graphs replay full rounds: their floor is the
            # slope's, not that of the mode's own "draft" steps (the few a plan runs alone, of
            # the rows left near the requests' ends)
            step = r["kinds"].get(_CLOCK_KINDS.get(kind, kind))
            if kind in slope_floors.get(r["mode"], {}):
                step = {"floor_ms": slope_floors[r["mode"]][kind]}
            floor, note = _batch_floor(step, batch) if step else (None, "")
            # an asynchronous run's steps differ (verify rows on some): its mean is its cost
            rows.append({"mode": r["mode"], "kind": kind, "replays": g["replays"],
                         "median_ms": g["median_ms"], "mean_ms": g.get("mean_ms", g["median_ms"]),
                         "floor_ms": floor, "note": note})  # fmt: skip
    return rows


def graph_kinds_table(results: list[dict], batch: int | None = None) -> str:
    """``graph_kind_rows`` as a table, with each kind's ratios to its floor."""
    lines = ["| mode | graph kind | replays | GPU ms a replay (median) | mean | floor ms "
             "| ratio (median) | ratio (mean) |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for g in graph_kind_rows(results, batch):
        floor = g["floor_ms"]
        cells = (f"{floor:.3f}{g['note']} | {g['median_ms'] / floor:.2f}x "
                 f"| {g['mean_ms'] / floor:.2f}x") if floor else "- | - | -"  # fmt: skip
        lines.append(f"| {g['mode']} | {g['kind']} | {g['replays']} | {g['median_ms']:.3f} "
                     f"| {g['mean_ms']:.3f} | {cells} |")  # fmt: skip
    return "\n".join(lines)


def plot_graph_kinds(results: list[dict], batch: int | None, path: str, title: str) -> bool:
    """A PNG of ``graph_kind_rows``' kinds with a floor: GPU ms a replay (mean) beside the floor,
    the ratio over each pair. False where matplotlib is missing (the GPU host has none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [g for g in graph_kind_rows(results, batch) if g["floor_ms"]]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(7.5, 1.2 * len(rows)), 4.2))
    ax.bar([i - 0.2 for i in x], [g["mean_ms"] for g in rows], 0.4, label="GPU ms a replay (mean)")
    ax.bar([i + 0.2 for i in x], [g["floor_ms"] for g in rows], 0.4,
           label="floor = bytes / copy bandwidth")  # fmt: skip
    for i, g in zip(x, rows, strict=True):
        ax.annotate(f"{g['mean_ms'] / g['floor_ms']:.2f}x", (i, g["mean_ms"]), ha="center",
                    va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(list(x), [f"{g['mode']}\n{g['kind']}" for g in rows], fontsize=8)
    ax.set_ylabel("ms")
    ax.set_ylim(0, 1.25 * max(g["mean_ms"] for g in rows))  # room for the legend above
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def graph_ratios(results: list[dict]) -> list[dict]:
    """Each round mode's draft and verify graphs against the run's `ar` decode graph, in GPU
    ms a replay (medians, the graph clock): c = draft / `ar`, and verify / `ar` with the
    verification's queries a row (gamma + 1, from the mode's gN). Issue 14 asks c <= 0.3 and
    a 6-query verification <= 1.15x an `ar` step. Empty without an `ar` run on the clock."""
    ar = next((r["graph_kinds"]["decode"]["median_ms"] for r in results
               if "decode" in r.get("graph_kinds", {})), None)  # fmt: skip
    if ar is None:
        return []
    out = []
    for r in results:
        kinds = r.get("graph_kinds", {})
        bg = _gamma_mode(r["mode"])
        if bg is None or "draft" not in kinds or "verify" not in kinds:
            continue
        out.append({"mode": r["mode"], "ar_ms": ar, "draft_ms": kinds["draft"]["median_ms"],
                    "verify_ms": kinds["verify"]["median_ms"], "queries": bg[1] + 1,
                    "c": kinds["draft"]["median_ms"] / ar,
                    "verify_vs_ar": kinds["verify"]["median_ms"] / ar})  # fmt: skip
    return out


def ratios_table(ratios: list[dict]) -> str:
    lines = ["| mode | `ar` graph ms | draft graph ms | c | verify graph ms (queries a row) "
             "| verify / `ar` |", "|---|---|---|---|---|---|"]  # fmt: skip
    for g in ratios:
        lines.append(f"| {g['mode']} | {g['ar_ms']:.3f} | {g['draft_ms']:.3f} | {g['c']:.3f} "
                     f"| {g['verify_ms']:.3f} ({g['queries']}) | {g['verify_vs_ar']:.3f}x |")
    return "\n".join(lines)


def draft_slopes(results: list[dict]) -> list[dict]:
    """A synchronized round's draft step alone: the slope between two rounds of one mode at
    different gamma (modes "MODE/gA" and "MODE/gB" of one run, e.g. aspire_fixed/g3 and
    aspire_fixed/g7), whose difference is gB - gA draft steps and nothing else (the same
    verification, the same plan). Per mode: wall ms, floor ms (bytes / bandwidth), ratio,
    GPU-busy ms where profiled, and c = the draft step over the run's `ar` step if it has one.
    The verification is what the shorter round holds besides its drafts: verify_ms = round(gA)
    - gA * draft step (wall; a step of gA + 1 queries a row), its floor likewise, and
    verify_vs_ar = verify_ms over the `ar` step (issue 14: a 6-query row <= 1.15x).
    """
    ar = next((r["kinds"]["ar"] for r in results if "ar" in r["kinds"]), None)
    by_base: dict[str, list[tuple[int, dict]]] = {}
    for r in results:
        bg = _gamma_mode(r["mode"])
        if bg is None or "round" not in r["kinds"]:
            continue
        by_base.setdefault(bg[0], []).append((bg[1], r["kinds"]["round"]))
    out = []
    for base, rounds in by_base.items():
        if len(rounds) < 2:
            continue
        (ga, a), (gb, b) = min(rounds, key=lambda x: x[0]), max(rounds, key=lambda x: x[0])
        steps = gb - ga
        if steps == 0:  # one gamma twice (runs joined, e.g. greedy and sampled): no slope
            continue
        wall = (b["wall_ms"] - a["wall_ms"]) / steps
        floor = (b["floor_ms"] - a["floor_ms"]) / steps
        row = {"mode": base, "gammas": [ga, gb], "wall_ms": wall, "floor_ms": floor,
               "ratio": wall / floor}  # fmt: skip
        if "gpu" in a and "gpu" in b:
            row["busy_ms"] = (b["gpu"]["busy_ms"] - a["gpu"]["busy_ms"]) / steps
            row["busy_ratio"] = row["busy_ms"] / floor
        row["verify_queries"] = ga + 1
        row["verify_ms"] = a["wall_ms"] - ga * wall
        row["verify_floor_ms"] = a["floor_ms"] - ga * floor
        row["verify_ratio"] = row["verify_ms"] / row["verify_floor_ms"]
        if ar is not None:
            row["c"] = wall / ar["wall_ms"]
            row["verify_vs_ar"] = row["verify_ms"] / ar["wall_ms"]
        out.append(row)
    return out


def slopes_table(slopes: list[dict]) -> str:
    lines = ["| mode | gammas | draft step ms | floor ms | ratio | GPU busy ms (ratio) | c "
             "| verify step ms (queries a row) | floor ms | ratio | vs `ar` step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in slopes:
        busy = f"{s['busy_ms']:.2f} ({s['busy_ratio']:.2f}x)" if "busy_ms" in s else "-"
        c = f"{s['c']:.2f}" if "c" in s else "-"
        vs_ar = f"{s['verify_vs_ar']:.2f}x" if "verify_vs_ar" in s else "-"
        lines.append(f"| {s['mode']} | {s['gammas'][0]}, {s['gammas'][1]} | {s['wall_ms']:.2f} "
                     f"| {s['floor_ms']:.3f} | {s['ratio']:.2f}x | {busy} | {c} "
                     f"| {s['verify_ms']:.2f} ({s['verify_queries']}) "
                     f"| {s['verify_floor_ms']:.3f} | {s['verify_ratio']:.2f}x | {vs_ar} |")
    return "\n".join(lines)


if __name__ == "__main__":  # the tables of stored bench_floor JSONs (their results joined)
    args = sys.argv[1:]
    png = args.pop(args.index("--plot") + 1) if "--plot" in args else None
    args = [a for a in args if a != "--plot"]
    if not args:
        sys.exit("usage: python3 scripts/floor_report.py FLOOR.json [FLOOR.json ...] "
                 "[--plot PNG]")  # fmt: skip
    reports = [json.load(gzip.open(path, "rt") if path.endswith(".gz") else open(path))
               for path in args]  # FLOOR.json or FLOOR.json.gz (docs/ keeps the large ones so)
    joined = [r for rep in reports for r in rep["results"]]
    batch = reports[0]["args"].get("batch")
    print(table(joined, reports[0]["bandwidth"]))
    if any(r.get("graph_kinds") for r in joined):
        print()
        print(graph_kinds_table(joined, batch))
        if png:  # the graph kinds against their floors
            a = reports[0]["args"]
            title = (f"{a.get('dummy_shapes') or a['model'].rsplit('/', 1)[-1]}, context "
                     f"{a['context']}, batch {batch}, {reports[0]['gpu']}")  # fmt: skip
            drawn = plot_graph_kinds(joined, batch, png, title)
            print(f"\n{png}" if drawn else "\nmatplotlib is not installed: no plot")
    if draft_slopes(joined):
        print()
        print(slopes_table(draft_slopes(joined)))
    if graph_ratios(joined):
        print()
        print(ratios_table(graph_ratios(joined)))
