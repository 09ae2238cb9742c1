"""scripts/bench_fused_epilogues.py: one CPU run (Triton's interpreter, untimed) of every variant,
check and sweep config on tiny shapes: valid JSON, fused outputs close to the unfused ones."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import SCRIPTS, one_thread_env


@pytest.mark.timeout(120)
def test_script_runs_on_cpu(tmp_path):
    out = tmp_path / "fused.json"
    cmd = [sys.executable, str(SCRIPTS / "bench_fused_epilogues.py"), "--device", "cpu",
           "--model-shape", "tiny", "--dtype", "float16", "--tokens", "5,16", "--layers", "2",
           "--out", str(out)]  # fmt: skip
    env = dict(one_thread_env(), TRITON_INTERPRET="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["gpu"] is None and "--tokens 5,16" in data["command"]
    assert [r["tokens"] for r in data["results"]] == [5, 16]
    for r in data["results"]:
        assert len(r["us"]) == 6 and all(t is None for t in r["us"].values())  # untimed
        # random fp16 inputs: the interpreter's matmul may round a sum by its block's shape
        assert all(c["max_abs_diff"] < 2e-3 for c in r["checks"].values()), r["checks"]
        runs = {name: len(runs) for name, runs in r["sweep"].items()}
        assert runs == {"c_qkv_rope_fused": 7, "f_gate_up_silu_fused": 7}  # each ran, matched
    assert "qkv_fused_vs_triton" in proc.stdout
