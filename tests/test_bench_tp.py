"""scripts/bench_tp.py: its TP=N vs TP=1 arithmetic on hand-made records, and end-to-end CPU runs
(gloo) on a tiny random model: three modes in one process, and one process per run with a
failing run kept as an error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import SCRIPTS, scripts_imported


@pytest.fixture(scope="module")
def bt():
    with scripts_imported("bench_tp") as (module,):
        yield module


def _rec(tp, mode="ar", batch=16, tps=100.0, steps=None, tokens=None, **extra):
    return dict(target="m", tp=tp, mode=mode, batch=batch, tokens_per_s=tps,
                step_ms_by_kind=steps or {"verify": 10.0}, orchestration_fraction=0.02,
                token_ids=tokens or [[1, 2, 3, 4], [5, 6]], **extra)  # fmt: skip


def test_compare_by_hand(bt):
    records = [
        _rec(1, steps={"verify": 10.0, "draft": 4.0}),
        # TP=2: 1.5x the tokens/s; verify 5.5 ms, draft 2.0 ms; request 0 diverges at position 2
        _rec(2, tps=150.0, steps={"verify": 5.5, "draft": 2.0, "round": 9.0},
             tokens=[[1, 2, 9, 4], [5, 6]]),  # fmt: skip
        _rec(1, mode="aspire", batch=64, tps=80.0),
        _rec(2, mode="aspire", batch=64, skipped="the KV pool holds 40 requests"),
        _rec(2, mode="magicdec"),  # no TP=1 run to compare with
    ]
    [c] = bt.compare(records, ref_tp=1)
    assert (c["mode"], c["batch"], c["tp"]) == ("ar", 16, 2)
    assert c["speedup"] == pytest.approx(1.5)
    assert c["scaling_efficiency"] == pytest.approx(0.75)  # TP=1 time / (2 x TP=2 time)
    assert c["step_ratio_by_kind"] == pytest.approx({"verify": 0.55, "draft": 0.5})
    assert c["meets_step_target"] is True
    # positions up to each request's first divergence: 2 of 4 + 2 of 2
    assert c["greedy_match_rate"] == pytest.approx(4 / 6)
    assert c["identical_requests"] == 0.5
    text = bt.table(records, [c])
    row = "| m | ar | 16 | 2 | 150 | x1.50 | 0.75 | verify 5.50 (0.55x); draft 2.00 (0.50x); " \
        "round 9.00 | 2.0% | 0.667 | 0.50 |"  # fmt: skip
    assert row in text
    assert "| m | ar | 16 | 1 | 100 | - | - | verify 10.00; draft 4.00 | 2.0% | - | - |" in text
    assert "| m | aspire | 64 | 2 | the KV pool holds 40 requests |" in text
    assert "| m | magicdec | 16 | 2 | 100 | - | - | verify 10.00 |" in text


def test_step_target(bt):
    assert bt._meets({"verify": 0.55, "draft": 0.61}) is False
    assert bt._meets({"async": 0.9}) is None  # neither ar's step nor a draft step ran
    assert bt._meets({"verify": 0.6, "async": 2.0}) is True


def test_targets(bt):
    import argparse

    both = bt._targets(argparse.Namespace(dummy_shapes=None, models=None))
    assert [t["label"] for t in both] == bt.DEFAULT_SHAPES + bt.DEFAULT_MODELS
    one = bt._targets(argparse.Namespace(dummy_shapes=["tiny-qwen3"], models=None))
    assert one == [{"label": "tiny-qwen3", "shape": "tiny-qwen3", "model": None}]
    path = bt._targets(argparse.Namespace(dummy_shapes=None, models=["/x/y/model.gguf"]))
    assert path == [{"label": "model.gguf", "shape": None, "model": "/x/y/model.gguf"}]


def _run(tmp_path, *extra, timeout):
    out = tmp_path / "tp.json"
    cmd = [sys.executable, str(SCRIPTS / "bench_tp.py"), "--device", "cpu", "--dtype", "float32",
           "--tp", "1,2", "--context", "120", "--max-tokens", "6", "--calibrate", "off",
           "--warmup", "1", "--out", str(out), *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


# one mode of each step shape: decode chains, rounds, asynchronous runs (every mode at TP=2
# against TP=1: tests/test_tp.py)
MODES = ("ar", "magicdec", "aspire")


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_modes_on_cpu(tmp_path):
    stdout, report = _run(tmp_path, "--dummy-shapes", "tiny-qwen3", "--batches", "3",
                          "--modes", ",".join(MODES), timeout=490)  # fmt: skip
    runs = report["results"]
    assert {(r["mode"], r["tp"], r["batch"]) for r in runs} == \
        {(m, tp, 3) for m in MODES for tp in (1, 2)}  # fmt: skip
    for r in runs:
        assert r["tokens_per_s"] > 0 and r["steps_by_kind"] and "token_ids" not in r
        assert 0 <= r["orchestration_fraction"] < 1
        assert r["step_ms_by_kind"].keys() == r["steps_by_kind"].keys()
        assert r["tp"] == 1 or r["orchestration_fraction"] > 0  # a Ray round trip
    assert len(report["comparisons"]) == len(MODES)
    for c in report["comparisons"]:
        # fp32 on gloo: TP=2 computes TP=1's function, so greedy output is the same
        assert c["greedy_match_rate"] == 1.0 and c["identical_requests"] == 1.0, c
        assert c["scaling_efficiency"] == pytest.approx(c["speedup"] / 2)
    for mode in MODES:  # progress as each run ends, then the table
        assert f"[tiny-qwen3 {mode} tp=2 batch 3]" in stdout
        assert f"| tiny-qwen3 | {mode} | 3 | 2 |" in stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_isolated_runs_keep_a_failure(tmp_path):
    stdout, report = _run(tmp_path, "--dummy-shapes", "tiny-qwen3", "--models",
                          str(tmp_path / "missing.gguf"), "--modes", "ar", "--batches", "2",
                          "--isolate", timeout=390)  # fmt: skip
    ok = [r for r in report["results"] if "error" not in r]
    failed = [r for r in report["results"] if "error" in r]
    assert {(r["target"], r["tp"]) for r in ok} == {("tiny-qwen3", 1), ("tiny-qwen3", 2)}
    assert {(r["target"], r["tp"]) for r in failed} == {("missing.gguf", 1), ("missing.gguf", 2)}
    [c] = report["comparisons"]
    assert c["identical_requests"] == 1.0
    assert "| missing.gguf | ar | 2 | 1 | error: exit status 1 |" in stdout
