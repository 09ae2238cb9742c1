"""scripts/bench_serve.py end to end on the CPU: a tiny random model offline and behind Ray Serve
(streaming clients), valid JSON with both paths, the ratio and the latency percentiles."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_serve.py"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_serve_cpu_smoke(tiny_chat_model, tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "bench_serve.json"
    engine = {"calibrate": "off", "num_pages": 128, "max_num_batched_tokens": 512}
    cmd = [sys.executable, str(SCRIPT), "--model", tiny_chat_model, "--device", "cpu",
           "--dtype", "float32", "--spec-mode", "aspire", "--engine-options", json.dumps(engine),
           "--num-prompts", "4", "--prompt-tokens", "200", "--max-tokens", "8",
           "--concurrency", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["offline"]["tokens_per_s"] > 0
    assert result["offline"]["output_tokens"] == 4 * 8
    served = result["served"]
    assert served["tokens_per_s"] > 0 and result["ratio"] > 0
    for key in ("ttft", "inter_chunk"):
        assert set(served[key]) == {"p50_ms", "p90_ms", "p99_ms"}
    assert len(served["requests"]) == 4
    for req in served["requests"]:
        assert req["completion_tokens"] == 8 and req["finish_reason"] == "length"
    assert "served / offline" in proc.stdout
