"""scripts/bench_decode.py with sampling filters: --temperature, --top-p and --top-k reach the
requests (a CPU run of SmolLM2's shapes on random weights, untimed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import SCRIPTS, one_thread_env


@pytest.mark.timeout(180)
def test_a_sampled_sweep_with_top_p_and_top_k_runs_on_cpu(tmp_path):
    out = tmp_path / "bd.json"
    cmd = [sys.executable, str(SCRIPTS / "bench_decode.py"), "--device", "cpu", "--dtype",
           "float32", "--dummy-shapes", "smollm2", "--contexts", "64", "--batch", "2",
           "--max-tokens", "4", "--modes", "ar,magicdec", "--temperature", "0.7", "--top-p",
           "0.9", "--top-k", "5", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=one_thread_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert (data["args"]["top_p"], data["args"]["top_k"]) == (0.9, 5)
    assert [r["mode"] for r in data["results"]] == ["ar", "magicdec"]
    assert all(r["tokens"] > 0 for r in data["results"])
