"""scripts/bench_fused_mlp.py: one CPU run (Triton's interpreter, untimed) of both variants on
tiny shapes: valid JSON, the one-launch MLP's norm output close to the separate kernels'."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import SCRIPTS, one_thread_env


@pytest.mark.timeout(120)
def test_script_runs_on_cpu(tmp_path):
    out = tmp_path / "fused_mlp.json"
    cmd = [sys.executable, str(SCRIPTS / "bench_fused_mlp.py"), "--device", "cpu",
           "--tokens", "5,16", "--layers", "2", "--out", str(out)]  # fmt: skip
    env = dict(one_thread_env(), TRITON_INTERPRET="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["gpu"] is None and "--tokens 5,16" in data["command"]
    assert [r["tokens"] for r in data["results"]] == [5, 16]
    for r in data["results"]:
        assert r["separate_us"] is None and len(r["fused"]) == 1  # untimed, one tile
        assert r["fused"][0]["us"] is None and r["fused"][0]["max_abs_diff"] < 1e-4
    assert "| 5 | - | - |" in proc.stdout
