"""scripts/bench_acceptance.py: the policies it is asked for, in order, in its JSON (written
after each one), and a clear refusal of a mode it cannot measure. SmolLM2 on the CPU, a short
window: seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers import one_thread_env

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_acceptance.py"


def _run(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, env=one_thread_env(), cwd=SCRIPT.parent)  # fmt: skip


def test_the_chosen_policies_in_order(tmp_path):
    out = tmp_path / "acceptance.json"
    proc = _run("--context", "256", "--requests", "1", "--max-tokens", "8", "--gamma", "2",
                "--modes", "specattn,magicdec", "--refresh-layers", "", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["mode"] for r in report["modes"]] == ["specattn", "magicdec"]
    assert report["refresh_layer_sweep"] == []
    for r in report["modes"]:
        assert r["verifications"] > 0 and 0.0 <= r["acceptance_rate"] <= 1.0
        assert 1.0 <= r["mean_accepted_length"] <= report["gamma"] + 1
        assert len(r["acceptance_by_position"]) == report["gamma"]


def test_a_mode_without_drafts_is_refused():
    proc = _run("--modes", "magicdec,ar", timeout=60)
    assert proc.returncode == 2
    assert "--modes: ['ar'] not among" in proc.stderr
