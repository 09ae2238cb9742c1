"""scripts/bench_decode.py writes its JSON after every mode: a run cut short (a device call's
time limit, a mode that fails) keeps the modes it measured (a CPU run of SmolLM2's shapes on
random weights, untimed)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import SCRIPTS, one_thread_env


@pytest.mark.timeout(180)
def test_a_run_that_fails_in_its_second_mode_keeps_the_first(tmp_path):
    out = tmp_path / "bd.json"
    # magicdec/refresh: the refresh layer asked of a window mode, refused when its engine is
    # built (SpecConfig), after `ar` has run
    cmd = [sys.executable, str(SCRIPTS / "bench_decode.py"), "--device", "cpu", "--dtype",
           "float32", "--dummy-shapes", "smollm2", "--contexts", "64", "--batch", "2",
           "--max-tokens", "4", "--modes", "ar,magicdec/refresh", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=one_thread_env())
    assert proc.returncode != 0 and "draft_refresh" in proc.stderr, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["results"]] == ["ar"]
    ar = data["results"][0]
    assert ar["tokens"] > 0 and ar["speedup_vs_ar"] == 1.0 and ar["context"] == "64"
    assert ar["greedy_token_match_vs_ar"] == 1.0 and "token_ids" not in ar
    # where a device call's time goes: the engine's start-up, the prompts, the whole run
    assert 0 < ar["prefill_s"] < ar["run_wall_s"] and ar["startup_s"] > 0
    assert "(start-up " in proc.stdout and ", prefill " in proc.stdout
    # the requests of this context its KV pool holds, printed before the runs (--batch max
    # sizes every mode's batch by the first mode's pool: a smaller one is warned of)
    assert ar["pool_holds"] >= ar["batch"] == 2 and "its KV pool holds" in proc.stdout
    assert "WARNING: batch" not in proc.stdout
    assert data["partial"] == "context 64: the modes up to ar"
