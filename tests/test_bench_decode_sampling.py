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


def test_profile_kernels_steps_the_engine_and_reports(tiny_model_dir):
    # bench_decode --profile-steps: N engine steps under torch's profiler, outputs kept (on
    # the CPU no kernel has GPU time: the report's kernels are empty, its steps counted)
    from helpers import random_prompts, scripts_imported

    from aspire_ray import SamplingParams
    from aspire_ray.engine.engine import LLMEngine
    from aspire_ray.llm import build_engine_config

    engine = LLMEngine(build_engine_config(tiny_model_dir("llama"), spec_mode="ar",
                                           num_pages=64, calibrate="off"))  # fmt: skip
    for i, prompt in enumerate(random_prompts(2, [8, 12], vocab=256, seed=1)):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    finished = {}
    with scripts_imported("bench_decode") as (bench_decode,):
        report = bench_decode.profile_kernels(engine, 50, finished)
    assert 1 <= report["steps"] < 50 and not engine.has_unfinished()  # the batch's end
    assert set(finished) == {"p0", "p1"} and report["wall_ms"] > 0
    assert report["kernel_ms"] == sum(k["ms"] for k in report["top"])
    assert report["launches"] == sum(k["calls"] for k in report["top"])
    assert set(report["gpu_clock"]) == {"replays", "busy_ms", "gap_ms"}  # no replay on a CPU


def test_profile_before_the_window_leaves_every_request_whole(tiny_model_dir):
    # --profile-before: the profiled steps come before the timed window (every row decoding),
    # not after it; every request still gets all its tokens, and the window times the rest
    from helpers import random_prompts, scripts_imported

    from aspire_ray import LLM, SamplingParams

    llm = LLM(model=tiny_model_dir("llama"), spec_mode="ar", num_pages=64, calibrate="off")
    prompts = random_prompts(2, [8, 12], vocab=256, seed=1)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (8, 40)]  # steps after
    with scripts_imported("bench_decode") as (bd,):
        before = bd.decode_run(llm, prompts, params, "before", profile_steps=2,
                               profile_before=True)  # fmt: skip
        after = bd.decode_run(llm, prompts, params, "after", profile_steps=2)
    llm.shutdown()
    assert [len(o.token_ids) for o in before["outs"]] == [8, 40] == \
        [len(o.token_ids) for o in after["outs"]]  # fmt: skip
    assert before["breakdown"]["kernels"]["steps"] == 2 == after["breakdown"]["kernels"]["steps"]
    # before: the window starts after the profiled steps, so it commits fewer of the batch's
    # tokens than the whole decode (48 less the 8 of the first plan, at least)
    assert 0 < before["tokens"] <= 48 - 8


@pytest.mark.parametrize("mode", ["ar", "aspire"])
def test_the_window_says_what_its_tokens_came_from(tiny_model_dir, mode):
    # decode_run's breakdown["window"]: the window's verifications (with drafts) and the
    # drafts they verified and accepted; every committed token is a verification's (accepted
    # drafts + the target's own token) or a plain step's, so the tokens bound them from above;
    # `ar` verifies no draft and holds none
    from helpers import random_prompts, scripts_imported

    from aspire_ray import LLM, SamplingParams

    llm = LLM(model=tiny_model_dir("llama"), spec_mode=mode, num_pages=64, calibrate="off",
              k_min=2, recent_pages=1, page_size=4, gamma=3, d_max=4)  # fmt: skip
    prompts = random_prompts(3, [20, 28, 36], vocab=256, seed=2)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (24, 30, 36)]
    with scripts_imported("bench_decode") as (bd,):
        run = bd.decode_run(llm, prompts, params, "w", window="drain")
    llm.shutdown()
    w = run["breakdown"]["window"]
    assert w["tokens"] == run["tokens"] > 0
    assert w["tokens"] >= w["verifications"] + w["drafts_accepted"]
    assert w["drafts_verified"] >= w["drafts_accepted"] >= 0
    assert w["drafts_held_start"] == 0 == w["drafts_held_end"]  # window "drain": nothing left
    if mode == "ar":
        assert w["verifications"] == w["drafts_verified"] == 0
    else:
        assert w["verifications"] > 0 and w["drafts_verified"] >= w["verifications"]
