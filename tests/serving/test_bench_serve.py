"""scripts/bench_serve.py end to end on the CPU: a tiny random model offline and behind Ray Serve
(streaming clients), valid JSON with both paths, the ratio and the latency percentiles, two
repeats of each path's timed part and their medians."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import one_thread_env

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
           "--concurrency", "4", "--repeats", "2", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230, env=one_thread_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["offline"]["tokens_per_s"] > 0
    assert result["offline"]["output_tokens"] == 4 * 8
    served = result["served"]
    assert served["tokens_per_s"] > 0 and result["ratio"] > 0
    for key in ("ttft", "inter_chunk"):
        assert set(served[key]) == {"p50_ms", "p90_ms", "p99_ms"}
    assert len(served["requests"]) == 4
    # a client a prompt: the steady-decode figures, the engine's steps read from /metrics (8
    # tokens may all come in the first chunks here: then no step after them)
    steady = served["steady_decode"]
    assert steady["engine_steps"] >= 0 and set(steady["inter_chunk"]) == {
        "p50_ms", "p90_ms", "p99_ms"}
    assert steady["engine_steps"] == 0 or steady["engine_step_ms"] > 0
    for req in served["requests"]:
        assert req["completion_tokens"] == 8 and req["finish_reason"] == "length"
    assert "served / offline" in proc.stdout and "steady decode" in proc.stdout
    # --repeats 2: each path's two timed runs, every one of all the tokens, and their medians
    medians = {}
    for path in ("offline", "served"):
        repeats = result[path]["repeats"]
        assert len(repeats) == 2 and all(r["output_tokens"] == 4 * 8 for r in repeats)
        assert all("requests" not in r for r in repeats)
        medians[path] = statistics.median(r["tokens_per_s"] for r in repeats)
        assert result[path]["tokens_per_s"] == pytest.approx(medians[path])
    assert result["ratio"] == pytest.approx(medians["served"] / medians["offline"])
    # the engine over each timed run, both paths: its steps ran inside the run's wall time
    for path in ("offline", "served"):
        for rep in result[path]["repeats"]:
            eng = rep["engine"]
            assert eng["steps"] > 0 and 0 < eng["worker_s"] <= eng["step_wall_s"]
            assert 0 < eng["busy_frac"] <= 1.0 and eng["step_ms"] > 0
            # its breakdown: by step kind (worker seconds adding up to the worker's) and phase
            parts = eng["breakdown"]
            kinds = [k for k in parts if k.endswith(" steps")]
            assert kinds and sum(parts[k.replace(" steps", " s")] for k in kinds) == \
                pytest.approx(eng["worker_s"])
            assert sum(parts[f"phase {p} s"] for p in ("schedule", "execute", "commit")) == \
                pytest.approx(eng["step_wall_s"])
    # and its KV pool: the same size on both paths (the offline engine's memory let go)
    pages = {path: [rep["engine"]["kv_pages"] for rep in result[path]["repeats"]]
             for path in ("offline", "served")}  # fmt: skip
    assert pages["offline"][0] > 0 and set(pages["offline"]) == set(pages["served"]), pages
    for row in ("offline #1", "offline #2", "offline median", "served x4 #1", "served x4 median"):
        assert f"| {row} |" in proc.stdout
    assert "| phase forward s |" in proc.stdout


def test_offline_and_served_engines_get_one_config(monkeypatch):
    """bench_serve's offline LLM and a replica build the same EngineConfig from one engine
    section (no model is loaded: LLM's engine is replaced by a recorder)."""
    import aspire_ray.llm as llm_module
    from aspire_ray.serving.settings import EngineArgs

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import bench_serve

    built = []
    # the config each LLM builds its engine from (a stand-in engine: nothing loads)
    monkeypatch.setattr(llm_module, "LLMEngine", lambda cfg: built.append(cfg) or SimpleNamespace())
    for engine in ({"model": "smollm2-135m-instruct", "spec_mode": "aspire", "dtype": "bfloat16",
                    "device": "cpu", "tp_size": 1},
                   {"model": "smollm2-135m-instruct", "spec_mode": "ar", "calibrate": "off",
                    "max_num_batched_tokens": 512, "num_pages": 64, "page_size": 32,
                    "spec_options": {"d_max": 4}}):
        llm_module.LLM(**bench_serve.offline_kwargs(engine))
        assert built.pop() == EngineArgs.model_validate(engine).to_engine_config()
