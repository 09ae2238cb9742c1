"""scripts/simulate.py and scripts/traces.py (issue 15, item 3): traces recorded from a real
greedy run of a tiny model on the CPU, replayed by the simulator (the engine's own scheduler
and draft policy over a trace-answering worker).

Invariants: `ar` commits one token per step per request; a fixed-gamma mode replayed from its
own trace at its recorded gamma repeats the recorded run round for round (same accepted length,
gamma histogram, acceptance by position, tokens); the adaptive modes land near the recorded
accepted length; the simulation is deterministic; the cost inputs load from every source."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import scripts_imported

from aspire_ray import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
GAMMA = 4
MODES = ("ar", "magicdec", "aspire_fixed", "aspire")
SPEC = dict(k_min=9, recent_pages=3)  # 13-17 pages of context: drafts see 9 of them


@pytest.fixture(scope="module")
def mods():
    names = ("traces", "simulate", "bench_decode")
    with scripts_imported(*names) as modules:
        yield dict(zip(names, modules, strict=True))


@pytest.fixture(scope="module")
def recorded(mods, tiny_model_dir, tmp_path_factory):
    """(trace file, Traces): ar, magicdec and aspire_fixed (gamma 4) and aspire, recorded."""
    tr, bd = mods["traces"], mods["bench_decode"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model runs faster on one thread than on two busy ones
    try:
        import random

        rng = random.Random(3)
        prompts = [[rng.randrange(256) for _ in range(n)] for n in (200, 240, 280)]
        params = SamplingParams(max_tokens=24, temperature=0.0, seed=0, ignore_eos=True)
        traces = tr.Traces({}, {}, [])
        for mode in MODES:
            llm = LLM(model=tiny_model_dir("llama"), spec_mode=mode, gamma=GAMMA,
                      calibrate="off", **SPEC)  # fmt: skip
            rec = tr.TraceRecorder(llm.engine)
            run = bd.decode_run(llm, prompts, params, mode)
            rec.detach()
            # the window's garbage collections and their seconds (no GPU: no allocator counts)
            process = run["breakdown"]["process"]
            assert min(process.values()) >= 0 and "gc0_seconds" in process
            assert "num_alloc_retries" not in process
            traces.add_run(mode, {}, run["outs"], rec)
            s = bd.summarize(mode, run, None)
            assert s["speedup_vs_ar"] is None  # no ar run to divide by (not 1.0)
            s.pop("token_ids")
            traces.modes[mode] = dict(s, gamma=GAMMA if mode in mods["simulate"].FIXED else None)
            traces.meta = dict(tr.engine_meta(llm.engine), context=240)
            llm.shutdown()
    finally:
        torch.set_num_threads(threads)
    path = tmp_path_factory.mktemp("traces") / "traces.json"
    traces.save(str(path))
    return path, tr.Traces.load(str(path))


def _costs(mods, **kw):
    return mods["simulate"].StepCosts(**{"b_model": 2e-3, "b_tok": 1e-5, "b_kv": 1e-7, **kw})


def test_accept_bits(mods):
    tr = mods["traces"]
    # round at 1: 2 of 3 accepted (1, 1, 0); round at 4 (after the target's token at 3): 4 of 4
    # accepted; position 8 follows a full acceptance: unknown
    assert tr.accept_bits(10, [(1, 3, 2), (4, 4, 4)]) == "?110" + "1111" + "??"
    t = tr.Traces({}, {"magicdec": {}, "magicdec/nochain": {}}, [tr.RequestTrace(5)])
    r = t.requests[0]
    r.tokens = {"magicdec": list(range(8)), "magicdec/nochain": list(range(8))}
    r.accept = {"magicdec": "?10??1??", "magicdec/nochain": "?1?0????"}
    tokens, bits, info = t.replay("magicdec")
    # own first, gaps from the other recording, then the nearest known bit before
    assert bits == ["11000111"] and info["source"] == "magicdec"
    assert info["unknown_frac"] == pytest.approx(3 / 7)


def test_ar_commits_one_token_per_step(mods, recorded):
    _, traces = recorded
    s = mods["simulate"].simulate(traces, "ar", _costs(mods, b_tok=0.0, b_kv=0.0))
    # 3 requests x 23 decode steps (the first token comes with the prefill), 2 ms each
    assert s["tokens"] == 3 * 23 and s["breakdown"]["step_kinds"] == {"prefill": 0, "verify": 23}
    assert s["tokens_per_s"] == pytest.approx(3 / 2e-3)
    assert s["mean_accepted_length"] == 1.0 and s["acceptance_rate"] is None
    # a projection: twice the batch (the recorded requests in turn), 1,000-token prompts
    big = mods["simulate"].simulate(traces, "ar", _costs(mods, b_tok=0.0), batch=6,
                                    prompt_len=1000)  # fmt: skip
    assert big["tokens"] == 6 * 23 and big["batch"] == 6
    per_step = 2e-3 + 1e-7 * 6 * (1000 + 12)  # the mean context of a step (+1 ... +23)
    assert big["tokens_per_s"] == pytest.approx(6 / per_step, rel=1e-3)


@pytest.mark.parametrize("mode", ["magicdec", "aspire_fixed"])
def test_fixed_gamma_replays_the_recorded_run(mods, recorded, mode):
    _, traces = recorded
    s = mods["simulate"].simulate(traces, mode, _costs(mods), GAMMA)
    rec = traces.modes[mode]
    assert s["trace"]["source"] == mode and s["gamma"] == GAMMA
    assert s["mean_accepted_length"] == pytest.approx(rec["mean_accepted_length"])
    assert s["gamma_histogram"] == {int(k): v for k, v in rec["gamma_histogram"].items()}
    assert s["acceptance_by_position"] == pytest.approx(rec["acceptance_by_position"])


def test_adaptive_modes_near_the_recorded_run(mods, recorded):
    _, traces = recorded
    sim = mods["simulate"]
    for mode, source in (("aspire", "aspire"), ("aspire_fsm", "aspire_fixed")):
        # the coefficients the recorded aspire run decided by (here the prior: too few step
        # shapes on the CPU for a fit), so that the simulated requests choose alike
        cm = traces.modes["aspire"]["breakdown"]["cost_model"]
        costs = sim.StepCosts(cm["b_model"], cm["b_tok"], cm["b_kv"])
        s = sim.simulate(traces, mode, costs)
        assert s["trace"]["source"] == source
        if mode in traces.modes:
            assert s["mean_accepted_length"] == pytest.approx(
                traces.modes[mode]["mean_accepted_length"], abs=0.3)
        # the replayed acceptance: what the source recorded per drafted position, roughly
        assert 1.0 <= s["mean_accepted_length"] <= 1.0 + GAMMA * 4


def test_deterministic_and_chains_cheaper(mods, recorded):
    _, traces = recorded
    sim = mods["simulate"]
    a = sim.simulate(traces, "aspire_fixed", _costs(mods), 3)
    b = sim.simulate(traces, "aspire_fixed", _costs(mods), 3)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    cheap = sim.simulate(traces, "aspire_fixed", _costs(mods, chain_b_model=0.0), 3)
    nochain = sim.simulate(traces, "aspire_fixed/nochain", _costs(mods, chain_b_model=0.0), 3)
    assert cheap["tokens"] == nochain["tokens"] == a["tokens"]
    # (a chain's steps are priced at its first step's context: a token shorter, each)
    assert cheap["tokens_per_s"] > a["tokens_per_s"] == pytest.approx(nochain["tokens_per_s"],
                                                                      rel=1e-3)


def test_costs_from_measurements(mods, tmp_path):
    sim = mods["simulate"]
    smol = {"num_layers": 30, "page_size": 16, "spec": {}}
    coef = tmp_path / "coef.json"
    coef.write_text(json.dumps({"b_model": 1e-3, "b_tok": 2e-6, "b_kv": 3e-9}))
    assert sim.load_costs(str(coef), "ar", smol).b_kv == 3e-9
    bench = ROOT / "docs" / "bench_decode_h200_chains.json"
    if bench.exists():
        ar = sim.load_costs(str(bench), "ar", smol)
        assert ar.chain_b_model is None and 0 < ar.host_per_plan < 5e-3
        md = sim.load_costs(str(bench), "magicdec", smol)
        # draft chains: the model's draft step at 8k is made to cost what was measured
        assert md.chain_b_model is not None and md.chain_b_model < md.b_model
        with pytest.raises(SystemExit, match="no measured run"):
            sim.load_costs(str(bench), "specattn", smol)
    stats = tmp_path / "stats.json"  # a run whose cost model kept its prior measured nothing
    stats.write_text(json.dumps({"cost_model": {"b_model": 1e-2, "b_tok": 1e-4, "b_kv": 1e-6,
                                                "status": "prior"}, "timings": {}, "steps": 9}))
    with pytest.raises(SystemExit, match="not fitted"):
        sim.load_costs(str(stats), "ar", smol)
    # an offset fit (the prior's slopes, the per-step term fitted) is the engine's own pricing
    stats.write_text(json.dumps({"cost_model": {"b_model": 1e-3, "b_tok": 1e-6, "b_kv": 4e-9,
                                                "status": "offset: r2 0.2 < 0.8"},
                                 "timings": {}, "steps": 9}))  # fmt: skip
    assert sim.load_costs(str(stats), "aspire", smol).b_model == 1e-3
    floor = ROOT / "docs" / "bench_floor_h200_qwen05b_32k_chains.json"
    if floor.exists():
        c = sim.load_costs(str(floor), "ar", smol)
        assert c.b_kv > 0 and c.chain_b_model is not None and c.chain_b_model < c.b_model


def test_mode_variants(mods):
    """bench_decode's MODE/VARIANT names (shared by the simulator): engine options, joined."""
    opts = mods["bench_decode"].mode_options
    assert opts("aspire/i5+s32") == ("aspire", {"gamma_init": 5, "async_steps": 32})
    assert opts("aspire_fixed/g8+twolaunch") == (
        "aspire_fixed", {"gamma": 8, "attention_options": {"mixed_one_launch": False}})
    assert opts("aspire/q4") == ("aspire", {"verify_quantum": 4})
    assert opts("aspire/q4+e90") == ("aspire", {"verify_quantum": 4, "alpha_ema": 0.9})
    assert opts("ar/det") == ("ar", {"deterministic": True})
    assert opts("aspire_fsm/f8+g8") == ("aspire_fsm", {"fsm_min": 8, "fsm_max": 8, "gamma": 8})
    with pytest.raises(SystemExit, match="unknown mode variant 'x5'"):
        opts("aspire/x5")
    # every variant's attention options are AttentionConfig fields (a typo would only fail
    # on the GPU host, at the engine's start)
    from aspire_ray.attention.triton_backend import TritonBackend

    for options in mods["bench_decode"].VARIANTS.values():
        TritonBackend(**options.get("attention_options", {}))  # raises on an unknown name
    assert TritonBackend(**opts("magicdec/g8+fmerge")[1]["attention_options"]).config.fused_merge
    assert not TritonBackend(
        **opts("magicdec/g8+sepmerge")[1]["attention_options"]).config.fused_merge
    # the split-KV fit's settings by number, joined with a variant's attention options
    joined = TritonBackend(**opts("aspire/sepmerge+rp48+mc64")[1]["attention_options"]).config
    assert (joined.ramp_pages, joined.min_chunk_pages, joined.fused_merge) == (48, 64, False)
    assert opts("aspire/rp32+norefresh") == ("aspire", {"attention_options": {"ramp_pages": 32},
                                                        "draft_refresh": False})
    # the attention launch's knobs by number (ATTENTION_KNOBS): AttentionConfig fields
    knobs = TritonBackend(**opts("ar/bn64+nw8+ns4+rs5+reg96")[1]["attention_options"]).config
    assert (knobs.block_n, knobs.num_warps, knobs.num_stages, knobs.resident_programs,
            knobs.max_registers) == (64, 8, 4, 5, 96)
    # the refresh switch: the engine option, and the traces' page policy that follows it
    assert opts("aspire/norefresh") == ("aspire", {"draft_refresh": False})
    policy_of = mods["traces"].policy_of
    assert [policy_of(m) for m in ("aspire", "aspire/norefresh", "aspire_fixed/g8+norefresh",
                                   "specattn/g8", "specattn/g8+refresh", "magicdec", "ar")] \
        == ["refresh", "verify_topk", "verify_topk", "verify_topk", "refresh", "window", None]


def test_environment_variants(mods, monkeypatch):
    """``nopdl`` / ``pdl``: no engine option, the kernels' switch (kernels/pdl.py) set for that
    mode's engine and unset (its default) for the others, whatever the caller's environment."""
    bd = mods["bench_decode"]
    assert bd.mode_options("ar/pdl") == ("ar", {})
    assert bd.mode_options("magicdec/g8+pdl") == ("magicdec", {"gamma": 8})
    assert bd.mode_env("ar/pdl") == {"ASPIRE_PDL": "1"} == bd.mode_env("magicdec/g8+pdl")
    assert bd.mode_options("ar/nopdl") == ("ar", {})
    assert bd.mode_env("ar/nopdl") == {"ASPIRE_PDL": "0"} == bd.mode_env("magicdec/g8+nopdl")
    assert bd.mode_env("ar") == {"ASPIRE_PDL": None} == bd.mode_env("magicdec/g8")
    monkeypatch.setenv("ASPIRE_PDL", "1")
    with bd.mode_environment("magicdec/g8"):
        assert "ASPIRE_PDL" not in os.environ
    with bd.mode_environment("magicdec/g8+pdl"):
        assert os.environ["ASPIRE_PDL"] == "1"
    assert os.environ["ASPIRE_PDL"] == "1"  # the caller's, back
    monkeypatch.delenv("ASPIRE_PDL")
    with bd.mode_environment("ar/pdl"):
        assert os.environ["ASPIRE_PDL"] == "1"
    assert "ASPIRE_PDL" not in os.environ


def test_costs_from_measured_steps(mods):
    """Runs whose cost model kept its prior (`ar`; the round modes, whose plans mix a chain and
    its verification) are priced from their own measured steps: b_kv from `ar`'s steps past
    the prior's b_model, and one per-forward term that makes the model's `ar` step and a
    round of g drafts and a verification cost what was measured."""
    sim = mods["simulate"]
    meta = {"num_layers": 24, "page_size": 16, "spec": {}, "mean_prompt_len": 32000}
    prior = {"b_model": 2.5e-4, "b_tok": 1e-6, "b_kv": 4e-9, "r2": None}

    def run(mode, kinds, seconds, gamma=None):
        cm = {**prior, "status": "prior: 2 distinct step shapes < 6", "prior": prior}
        b = {"cost_model": cm, "step_kinds": {"prefill": 0, **kinds},
             "step_seconds": {"prefill": 0.0, **seconds}, "steps": 6,
             "timings": {"total": sum(seconds.values())}}  # fmt: skip
        return {"mode": mode, "batch": 64, "context": "32000", "tokens": 64 * 128,
                "decode_seconds": sum(seconds.values()) + 0.06, "gamma": gamma, "breakdown": b}

    results = [run("ar", {"verify": 100}, {"verify": 0.75}),
               run("aspire_fixed", {"round": 24}, {"round": 0.456}, gamma=5)]
    ar = sim.costs_from_steps(results[0], results, meta, "test")
    af = sim.costs_from_steps(results[1], results, meta, "test")
    assert af.b_kv == ar.b_kv != prior["b_kv"] and af.b_tok == prior["b_tok"]
    assert ar.b_model == ar.chain_b_model == pytest.approx(prior["b_model"])
    assert af.b_model == af.chain_b_model > ar.b_model  # a draft forward's launches
    assert af.host_per_plan == pytest.approx(0.01)  # 60 ms outside the worker, 6 plans
    policy, ctx = sim._policy("aspire_fixed", meta), 32000 + 64
    draft = af.worker_seconds(*sim._rows_features(policy, sim.RowKind.DRAFT, ctx, 0, 64))
    verify = af.worker_seconds(*sim._rows_features(policy, sim.RowKind.VERIFY, ctx, 5, 64))
    assert 5 * draft + verify == pytest.approx(0.456 / 24)  # the measured round
    step = ar.worker_seconds(*sim._rows_features(sim._policy("ar", meta), sim.RowKind.VERIFY,
                                                 ctx, 0, 64))  # fmt: skip
    assert step == pytest.approx(0.75 / 100)
    with pytest.raises(SystemExit, match="no round or `ar` step"):
        sim.costs_from_steps(run("magicdec", {"draft": 5}, {"draft": 0.01}), results, meta, "t")


def test_a_mode_with_its_own_gamma_is_priced_and_swept_at_it(mods):
    # "aspire_fixed/g8": its rounds are of 8 drafts (the per-forward term comes from them)
    sim = mods["simulate"]
    meta = {"num_layers": 24, "page_size": 16, "spec": {}, "mean_prompt_len": 32000}
    prior = {"b_model": 2.5e-4, "b_tok": 1e-6, "b_kv": 4e-9, "r2": None}
    cm = {**prior, "status": "prior: 2 distinct step shapes < 6", "prior": prior}
    b = {"cost_model": cm, "step_kinds": {"round": 10}, "step_seconds": {"round": 0.25},
         "steps": 3, "timings": {"total": 0.25}}  # fmt: skip
    r = {"mode": "aspire_fixed/g8", "batch": 64, "context": "32000", "tokens": 64 * 90,
         "decode_seconds": 0.26, "breakdown": b}  # fmt: skip
    costs = sim.costs_from_steps(r, [r], meta, "t")
    policy, ctx = sim._policy("aspire_fixed", meta), 32000 + 45
    draft = costs.worker_seconds(*sim._rows_features(policy, sim.RowKind.DRAFT, ctx, 0, 64))
    verify = costs.worker_seconds(*sim._rows_features(policy, sim.RowKind.VERIFY, ctx, 8, 64))
    assert 8 * draft + verify == pytest.approx(0.25 / 10)


def test_an_asynchronous_run_is_priced_by_the_gpu_clock(mods):
    """A diagnosed `aspire` run (bench_decode --diagnose): a step at the window's mean costs
    the mean replay's GPU time, and a plan's host time is the GPU's idle time a plan."""
    sim = mods["simulate"]
    meta = {"num_layers": 24, "page_size": 16, "spec": {}, "mean_prompt_len": 32000,
            "query_tile_tokens": 9}  # fmt: skip
    cm = {"b_model": 3e-4, "b_tok": 3e-6, "b_kv": 4.4e-9, "status": "offset: r2 -0.6 < 0.8"}
    clock = {"replays": 150, "busy_ms": 480.0, "gap_ms": 18.0}
    b = {"cost_model": cm, "step_kinds": {"async": 144}, "step_seconds": {"async": 0.47},
         "steps": 9, "timings": {"total": 0.47}, "gpu_clock": clock}  # fmt: skip
    r = {"mode": "aspire/q4", "batch": 64, "context": "32000", "tokens": 7600,
         "decode_seconds": 0.51, "gamma_mean": 5.4, "breakdown": b}  # fmt: skip
    costs = sim.costs_from_clock(r, meta, "t")
    assert costs.host_per_plan == pytest.approx(0.018 / 9)
    assert (costs.b_tok, costs.b_kv) == (cm["b_tok"], cm["b_kv"])
    assert costs.chain_b_model == costs.b_model  # the sim prices async steps as chained
    policy, ctx, g = sim._policy("aspire", meta), 32000 + 7600 // 128, 5
    draft = sim._rows_features(policy, sim.RowKind.DRAFT, ctx, 0, 64)
    verify = sim._rows_features(policy, sim.RowKind.VERIFY, ctx, g, 64)
    mean = [(g * d + v) / (g + 1) for d, v in zip(draft, verify, strict=True)]
    assert costs.worker_seconds(*mean) == pytest.approx(0.48 / 150)


def test_replays_with_verify_rows_timed_apart_price_a_mixed_step(mods):
    """The clock's "async" (draft rows only) and "async_verify" replays: a draft-only step
    costs the first kind's mean, a step holding the window's verifications (each row once in
    g + 1 steps, shared by the replays with verify rows) the second's, past its linear terms
    by b_mixed."""
    sim = mods["simulate"]
    meta = {"num_layers": 24, "page_size": 16, "spec": {}, "mean_prompt_len": 32000,
            "query_tile_tokens": 9}  # fmt: skip
    cm = {"b_model": 3e-4, "b_tok": 3e-6, "b_kv": 4.4e-9, "status": "offset: r2 -0.6 < 0.8"}
    kinds = {"async": {"replays": 66, "mean_ms": 1.9, "median_ms": 1.89},
             "async_verify": {"replays": 66, "mean_ms": 4.7, "median_ms": 4.69}}
    clock = {"replays": 132, "busy_ms": 435.0, "gap_ms": 0.8, "by_kind": kinds}
    b = {"cost_model": cm, "step_kinds": {"async": 128}, "step_seconds": {"async": 0.39},
         "steps": 8, "timings": {"total": 0.39}, "gpu_clock": clock}  # fmt: skip
    r = {"mode": "aspire/norefresh", "batch": 64, "context": "32000", "tokens": 6668,
         "decode_seconds": 0.44, "gamma_mean": 6.36, "breakdown": b}  # fmt: skip
    costs = sim.costs_from_clock(r, meta, "t")
    policy, ctx, g = sim._policy("aspire/norefresh", meta), 32000 + 6668 // 128, 6
    draft = sim._rows_features(policy, sim.RowKind.DRAFT, ctx, 0, 1)
    verify = sim._rows_features(policy, sim.RowKind.VERIFY, ctx, g, 1)
    assert costs.worker_seconds(64 * draft[0], 64 * draft[1]) == pytest.approx(1.9e-3)
    v = 64 * 2 / (g + 1)  # verify rows a replay with verify rows holds: 18.3
    step = [v * x + (64 - v) * y for x, y in zip(verify, draft, strict=True)]
    assert costs.b_mixed > 0
    assert costs.worker_seconds(*step) + costs.b_mixed == pytest.approx(4.7e-3)
    assert costs.host_per_plan == pytest.approx(0.8e-3 / 8)


def test_generations_repeated_to_a_length(mods, recorded):
    sim = mods["simulate"]
    assert sim.repeated("1011", 9) == "101101101"  # position 0 (the prompt's) not again
    assert sim.repeated([5, 6, 7], 6) == [5, 6, 7, 6, 7, 6]
    assert sim.repeated("10", 1) == "1"
    _, traces = recorded
    short = sim.simulate(traces, "aspire_fixed", _costs(mods), GAMMA, window="drain")
    longer = sim.simulate(traces, "aspire_fixed", _costs(mods), GAMMA, window="drain",
                          num_tokens=60)  # fmt: skip
    # (the window's tokens: the first of each request comes with its prompt)
    assert longer["tokens"] == 59 * len(traces.requests) > short["tokens"]
    # what they came from, as bench_decode reports a measured window (its verifications and
    # their drafts); a drained window leaves no draft held
    w = longer["breakdown"]["window"]
    assert w["tokens"] == longer["tokens"] and w["verifications"] > 0
    assert w["drafts_verified"] >= w["drafts_accepted"] > 0
    assert w["drafts_held_start"] == 0 == w["drafts_held_end"]
    # the recorded acceptance, again and again: about the same accepted length
    assert longer["mean_accepted_length"] == pytest.approx(short["mean_accepted_length"],
                                                           rel=0.25)  # fmt: skip


@pytest.mark.timeout(120)
def test_cli(recorded, tmp_path):
    path, _ = recorded
    coef = tmp_path / "coef.json"
    coef.write_text(json.dumps({"b_model": 2e-3, "b_tok": 1e-5, "b_kv": 1e-7,
                                "host_per_plan": 5e-4}))  # fmt: skip
    out = tmp_path / "sim.json"
    cmd = [sys.executable, str(SCRIPTS / "simulate.py"), "--traces", str(path), "--costs",
           str(coef), "--gammas", "2,6", "--measured", str(path), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["results"]
    got = {(r["mode"], r["gamma"]) for r in runs}
    for mode in ("magicdec", "aspire_fixed"):
        assert {(mode, 2), (mode, GAMMA), (mode, 6)} <= got
    assert {("ar", None), ("aspire_fsm", None), ("aspire", None)} <= got
    # no trace of specattn's page policy was recorded: skipped, with a note
    assert "specattn: skipped" in proc.stdout and not any(m == "specattn" for m, _ in got)
    assert "error_pct" in next(r for r in runs if r["mode"] == "magicdec" and r["gamma"] == 4)


def test_synthetic_traces_replay_their_acceptance(mods):
    """traces.synthetic: i.i.d. bits at each request's alpha. A fixed gamma's rounds then accept
    each position at that rate, and `aspire`'s pooled estimates land near it."""
    tr, sim = mods["traces"], mods["simulate"]
    alphas = [0.5, 0.9] * 4
    traces = tr.synthetic(alphas, prompt_len=3000, num_tokens=400, meta=tr.qwen_meta(), seed=1)
    bits = [r.accept["aspire_fixed"] for r in traces.requests]
    for alpha, b in zip(alphas, bits, strict=True):
        assert b.count("1") / len(b) == pytest.approx(alpha, abs=0.08)
    costs = _costs(mods, b_tok=1e-6, b_kv=4e-9)
    fixed = sim.simulate(traces, "aspire_fixed", costs, 1, window="drain")
    # one draft a round: the first position's acceptance is the mean alpha
    assert fixed["acceptance_by_position"][0] == pytest.approx(0.7, abs=0.05)
    seen = {}
    policy_cls = mods["simulate"].DraftPolicy
    orig = policy_cls.on_verified

    def record(self, req, drafted, accepted):
        orig(self, req, drafted, accepted)
        seen.setdefault(req.req_id, []).append(req.alpha)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(policy_cls, "on_verified", record)
        # without verify slots: the alpha-0.5 requests' rounds keep the policy's 1-2 drafts
        # (slots round them up to 3, and the pooled ratio of ~5 such rounds reads ~0.40)
        sim.simulate(traces, "aspire/q1", costs, window="drain")
    for i, alpha in enumerate(alphas):  # the mean estimate after the first ten verifications
        assert np.mean(seen[f"sim-{i}"][10:]) == pytest.approx(alpha, abs=0.06), i


def test_the_oracle_drafts_to_each_rejection(mods):
    """oracle_targets: drafts exactly to each request's next rejected position, so every draft
    is accepted, and with the same step costs it commits faster than the cost model's lengths;
    it needs one-step plans (an asynchronous run keeps its lengths through its rounds)."""
    tr, sim = mods["traces"], mods["simulate"]
    traces = tr.synthetic([0.6, 0.95] * 4, prompt_len=3000, num_tokens=300, meta=tr.qwen_meta(),
                          seed=2)  # fmt: skip
    costs = _costs(mods, b_tok=1e-6, b_kv=4e-9)
    plain = sim.simulate(traces, "aspire/s1+q1", costs, window="drain")
    oracle = sim.simulate(traces, "aspire/s1+q1", costs, window="drain", oracle=True)
    assert oracle["mode"] == "aspire/s1+q1+oracle"
    assert oracle["acceptance_rate"] == 1.0 and plain["acceptance_rate"] < 0.95
    assert oracle["tokens_per_s"] > plain["tokens_per_s"]
    tile = traces.meta.get("query_tile_tokens")  # a verification within one query tile
    assert tile is None or max(int(g) for g in oracle["gamma_histogram"]) <= tile - 1
    with pytest.raises(SystemExit, match="one-step plans"):
        sim.simulate(traces, "aspire", costs, window="drain", oracle=True)
    with pytest.raises(SystemExit, match="one-step plans"):
        sim.simulate(traces, "aspire_fixed", costs, 4, window="drain", oracle=True)


def test_mixed_steps_are_priced_apart(mods):
    """An asynchronous step holding verify and draft rows costs ``b_mixed`` more (§8.28); costs
    fitted to such steps lose it from their per-step term."""
    sim = mods["simulate"]
    from aspire_ray.plan import RowKind, RowPlan

    def row(held, gamma, steps=6):
        return RowPlan("r", RowKind.DRAFT, [1], 10, 0, [], num_steps=steps,
                       verify_after=[0] + [1] * held, async_gamma=gamma)  # fmt: skip

    # in phase (both verify at steps 2 and 5): no mixed step; out of phase: four
    assert sim.mixed_steps([row(0, 2), row(0, 2)]) == 0
    assert sim.mixed_steps([row(0, 2), row(1, 2)]) == 4
    base = sim.StepCosts(1e-3, 1e-6, 1e-9, 8e-4)
    fitted = sim.with_mixed_step(base, 3e-4, fitted_on_mixed=True)
    assert (fitted.b_model, fitted.chain_b_model, fitted.b_mixed) == pytest.approx(
        (7e-4, 5e-4, 3e-4))
    assert sim.with_mixed_step(base, 3e-4, fitted_on_mixed=False).b_model == base.b_model


def test_early_steps_dropped_cost_their_time(mods):
    """The worker starts the next asynchronous run's first steps with the draft lengths the run
    promised (``async_overlap_steps``); a next plan that keeps the promise continues them, one
    that breaks it (another draft length) drops them, and they cost their time again."""
    sim = mods["simulate"]
    from aspire_ray.llm import build_engine_config
    from aspire_ray.plan import RowKind, RowPlan, StepPlan

    cfg = build_engine_config("dummy", load_format="dummy", spec_mode="aspire", calibrate="off",
                              async_steps=8, async_overlap_steps=4)  # fmt: skip
    meta = {"num_layers": 4, "page_size": 16}
    ex = sim.TraceExecutor(cfg, meta, [100], [[7] * 64], ["1" * 64], _costs(mods))

    def plan(step, gamma, promise):
        row = RowPlan("r-0", RowKind.DRAFT, [7], 99, 0, [], num_steps=8, verify_after=[7],
                      async_gamma=gamma, next_async_gamma=promise)  # fmt: skip
        return StepPlan(step, [row], {}, [])

    ex.execute(plan(1, 3, 3))
    one_run = ex.worker_s
    ex.execute(plan(2, 3, 5))  # keeps the promise of 3: continued
    assert ex.early_steps_dropped == 0 and ex.worker_s == pytest.approx(2 * one_run)
    ex.execute(plan(3, 3, 5))  # breaks the promise of 5: the 4 started steps dropped
    assert ex.early_steps_dropped == 4
    assert ex.worker_s == pytest.approx(3 * one_run + 4 * one_run / 8)


def test_trace_files_may_be_gzipped(mods, recorded, tmp_path):
    # the trace files in docs/ are .json.gz (a GPU call carries the work tree in 64 MiB):
    # saved and loaded by name, the same traces, and the simulator's JSON readers take them
    tr = mods["traces"]
    _, traces = recorded
    path = tmp_path / "traces.json.gz"
    traces.save(str(path))
    with open(path, "rb") as f:
        assert f.read(2) == b"\x1f\x8b"  # gzip's magic
    again = tr.Traces.load(str(path))
    assert (again.meta, again.modes, again.requests) == (traces.meta, traces.modes,
                                                         traces.requests)  # fmt: skip
    assert mods["simulate"].measured_runs(str(path)).keys() == \
        mods["simulate"].measured_runs(str(recorded[0])).keys()  # fmt: skip
