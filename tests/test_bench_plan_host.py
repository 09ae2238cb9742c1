"""scripts/bench_plan_host.py: the engine and worker of ``aspire`` over graphs that do no work
plan steady asynchronous runs on the CPU (the host's time a plan, nothing of the device's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import one_thread_env

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.timeout(120)
def test_script_times_steady_plans_on_cpu(tmp_path):
    out = tmp_path / "host.json"
    cmd = [sys.executable, str(SCRIPTS / "bench_plan_host.py"), "--batch", "4", "--context",
           "64", "--max-tokens", "96", "--threads", "1", "--profile", "2", "--argmax-ids", "50",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=one_thread_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = json.loads(out.read_text())["results"]
    assert r["batch"] == 4 and r["plans"] >= 3
    # every steady plan ran on the (no-op) asynchronous-run graphs, the next run started early
    assert r["counters"]["async"] >= 3 * 16 and r["counters"]["runs_continued"] >= 2
    assert 0 < r["worker_ms_median"] < r["host_ms_median"]
    assert r["engine_ms_median"] > 0 and "async_runs.py" in r["profile_top"]
