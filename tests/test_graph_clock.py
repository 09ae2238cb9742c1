"""The graph clock's report (scripts/floor_report.clock_summary of what
aspire_ray/worker/graph_clock.py records) and bench_decode's sync log;
on a GPU (tests/test_gpu_engine.py) the clock times real replays and the graph-run paths are
checked for synchronizing calls."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import scripts_imported

from aspire_ray.worker.graph_clock import GraphClock


def summarize(intervals, host=(), launch_ms=None, kinds=None, shapes=None):
    with scripts_imported("floor_report") as (fr,):
        return fr.clock_summary({"intervals": intervals, "host": host, "launch_ms": launch_ms,
                                 "kinds": kinds, "shapes": shapes})  # fmt: skip


def test_summarize_splits_busy_and_gaps_by_phase():
    # a run continued (3 steps of 3 ms), 4 steps started early, then the next plan's
    # continuation 5 ms after the early steps ended: the plan boundary's idle
    intervals = [(0.0, 3.0, "async:continue"), (3.005, 6.0, "async:continue"),
                 (6.05, 9.0, "async:early"), (14.0, 17.0, "async:continue")]  # fmt: skip
    s = summarize(intervals)
    assert s["replays"] == 4 and s["span_ms"] == 17.0
    assert s["busy_ms"] == pytest.approx(11.945)
    assert s["gap_ms"] == pytest.approx(5.055)
    assert s["idle_frac"] == pytest.approx(5.055 / 17.0)
    counts = {g["upto_ms"]: (g["count"], round(g["ms"], 6)) for g in s["gaps"]}
    assert counts == {0.01: (1, 0.005), 0.1: (1, 0.05), 1.0: (0, 0.0), None: (1, 5.0)}
    assert list(s["between"]) == ["async:early -> async:continue",  # most idle first
                                  "async:continue -> async:early",
                                  "async:continue -> async:continue"]  # fmt: skip
    assert s["between"]["async:early -> async:continue"] == {"count": 1, "ms": 5.0, "max_ms": 5.0}
    assert s["by_phase"]["async:continue"]["replays"] == 3
    assert s["by_phase"]["async:early"]["busy_ms"] == pytest.approx(2.95)
    assert s["longest"][0] == {"ms": 5.0, "replay": 3, "between": "async:early -> async:continue"}


def test_host_marks_tell_the_work_queued_on_the_gpu():
    # the host woke 0.5 ms after the plan's last step ended (nothing started early: the GPU
    # ran dry), then launched the next plan's steps 4 ms later; in another plan it woke with
    # 6 ms of early steps still queued
    intervals = [(0.0, 3.0, "async:run"), (3.0, 9.0, "async:run"), (14.0, 17.0, "async:run"),
                 (17.0, 20.0, "async:early"), (20.0, 26.0, "async:early")]  # fmt: skip
    # (the second wait was for the first 3 replays: the host woke 3 ms after the third ended,
    # while the early steps ran)
    host = [(9.5, "async:woke", 2, 2), (13.0, "async:launch", 2, -1),
            (14.5, "async:launch", 3, -1), (20.0, "async:woke", 5, 3)]  # fmt: skip
    q = summarize(intervals, host)["host"]
    assert q["async:woke"] == {"count": 2, "queued_ms_median": 2.75, "queued_ms_min": -0.5,
                               "queued_ms_max": 6.0, "wake_latency_ms_median": 1.75,
                               "wake_latency_ms_max": 3.0}  # fmt: skip
    assert q["async:launch"]["queued_ms_min"] == -4.0 and q["async:launch"]["queued_ms_max"] == 2.5
    assert "wake_latency_ms_median" not in q["async:launch"]


def test_host_time_in_replay_calls_by_phase():
    # the continuation's second launch blocked 2.9 ms (a full launch queue): its phase's sum
    # and max say so; a record without launch times gives none
    intervals = [(0.0, 3.0, "async:continue"), (3.0, 6.0, "async:continue"),
                 (6.0, 9.0, "async:early")]  # fmt: skip
    phases = summarize(intervals, launch_ms=[0.02, 2.9, 0.03])["by_phase"]
    assert phases["async:continue"]["launch_host_ms"] == pytest.approx(2.92)
    assert phases["async:continue"]["launch_host_max_ms"] == pytest.approx(2.9)
    assert phases["async:early"]["launch_host_max_ms"] == pytest.approx(0.03)
    assert "launch_host_ms" not in summarize(intervals)["by_phase"]["async:early"]


def test_summarize_of_nothing():
    s = summarize([])
    assert s["replays"] == 0 and s["busy_ms"] == 0 and s["gap_ms"] == 0 and s["longest"] == []
    assert s["host"] == {}


class _Graph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's pass-through")
def test_clock_off_the_gpu_passes_replays_through():
    clock, graph = GraphClock(), _Graph()
    clock.start()
    assert not clock.enabled  # no CUDA: nothing to time
    with clock.phase("async:run"):
        with clock.phase("async:early"):
            assert clock._phase == "async:early"
            clock.replay(graph)
        assert clock._phase == "async:run"
    assert clock._phase == "other" and graph.replays == 1
    assert clock.collect()["intervals"] == []


def test_sync_sites_count_synchronizing_calls_by_line():
    with scripts_imported("bench_decode") as (bd,):
        with warnings.catch_warnings(record=True) as log:
            warnings.simplefilter("always")
            for _ in range(2):
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)
        sites = bd.sync_sites(log)
    assert len(sites) == 1 and list(sites.values()) == [2]
    assert next(iter(sites)).split(":")[0].endswith("test_graph_clock.py")


def test_replays_are_timed_by_step_kind():
    # a synchronized round: three draft steps and a verification, then `ar`-free idle; the
    # draft steps' GPU time is theirs inside the round (not a host-planned step's)
    intervals = [(0.0, 1.0, "round:run"), (1.0, 2.2, "round:run"), (2.2, 3.2, "round:run"),
                 (3.2, 8.2, "round:run")]  # fmt: skip
    kinds = summarize(intervals, kinds=["draft", "draft", "draft", "verify"])["by_kind"]
    assert kinds["draft"]["replays"] == 3 and kinds["verify"]["replays"] == 1
    assert kinds["draft"]["busy_ms"] == pytest.approx(3.2)
    assert kinds["draft"]["median_ms"] == pytest.approx(1.0)
    assert kinds["draft"]["mean_ms"] == pytest.approx(3.2 / 3)
    assert kinds["verify"]["median_ms"] == pytest.approx(5.0)
    assert summarize(intervals)["by_kind"] == {}  # an older record: no kinds


def test_steps_with_verify_rows_by_the_share_of_rows_verifying():
    # an asynchronous run at 160 rows: draft-only steps, a step where 30 rows verify (<= 25%),
    # two where 80 do (<= 50%) and one where all do: is a step of a few verifications priced
    # as its rows' share of a full one? (32k x 160, docs/benchmarks.md §8.58)
    intervals = [(0.0, 3.0, "async:run"), (3.0, 11.0, "async:run"), (11.0, 24.0, "async:run"),
                 (24.0, 38.0, "async:run"), (38.0, 64.0, "async:run")]  # fmt: skip
    kinds = ["async"] + ["async_verify"] * 4
    shapes = [(0, 160, 160), (30, 160, 370), (80, 160, 720), (80, 160, 720), (160, 160, 1440)]
    s = summarize(intervals, kinds=kinds, shapes=shapes)["by_verify_share"]
    assert list(s) == ["async_verify <=25%", "async_verify <=50%", "async_verify <=100%"]
    assert s["async_verify <=25%"]["replays"] == 1 and s["async_verify <=25%"]["median_ms"] == 8
    half = s["async_verify <=50%"]
    assert half["replays"] == 2 and half["mean_ms"] == pytest.approx(13.5)
    assert (half["mean_verify_rows"], half["mean_live_rows"], half["mean_tokens"]) == (80, 160, 720)
    assert s["async_verify <=100%"]["median_ms"] == 26
    # a record without shapes (a round's replays, an older JSON): none
    assert summarize(intervals, kinds=kinds)["by_verify_share"] == {}
    # and every replay in order, to read the window step by step
    seq = summarize(intervals, kinds=kinds, shapes=shapes)["sequence"]
    assert seq[0] == [0.0, 3.0, "async:run", "async", [0, 160, 160]]
    assert [r[1] for r in seq] == [3.0, 8.0, 13.0, 14.0, 26.0] and seq[4][4] == [160, 160, 1440]
