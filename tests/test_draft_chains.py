"""Draft chains (SpecConfig.draft_chains): a synchronized batch runs its remaining draft steps
back to back in one plan, drafts fed forward on the device, and, when that ends the round, its
verification in the same plan. Same tokens as one plan per draft step, and as plain
autoregressive decoding (fp32, CPU). Decode chains (SpecConfig.ar_chain): ``ar`` runs several
decode steps per plan, with the tokens of one plan per step."""

from __future__ import annotations

import pytest
from helpers import random_prompts, run_staggered, use_eager_graphs

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config

SPARSE = dict(k_min=3, recent_pages=1, rho=0.07, gamma=4, d_max=6)


def _run(model_dir, mode, temperature=0.0, **extra):
    cfg = build_engine_config(model_dir, spec_mode=mode, max_num_batched_tokens=64,
                              num_pages=120, **SPARSE, **extra)  # fmt: skip
    engine = LLMEngine(cfg)
    chains, rounds = [], []
    execute = engine.executor.execute

    def recording(plan):
        chains.append(max((row.num_steps for row in plan.rows), default=1))
        rounds.append(max((row.num_rounds for row in plan.rows if row.verify_after is not None),
                          default=0))  # rounds in the plan  # fmt: skip
        return execute(plan)

    engine.executor.execute = recording
    prompts = random_prompts(4, [30, 100, 150], vocab=256, seed=5)
    params = [SamplingParams(max_tokens=24, temperature=temperature, seed=7, ignore_eos=True)] * 4
    outs = run_staggered(engine, prompts, params, arrive_every=2)
    _run.most_rounds = max(rounds, default=0)  # most rounds one plan held
    round_plans = sum(1 for r in rounds if r)
    return outs, [k for k, r in zip(chains, rounds, strict=True) if not r] or [1], round_plans


@pytest.mark.parametrize("mode", ["magicdec", "aspire_fixed"])
def test_chains_give_the_tokens_of_single_draft_steps(tiny_model_dir, mode):
    model_dir = tiny_model_dir("llama")
    expected, *_ = _run(model_dir, "ar")
    single, single_chains, single_rounds = _run(model_dir, mode, draft_chains=False)
    chained, chains, no_rounds = _run(model_dir, mode, chain_verify=False)
    rounded, _, rounds = _run(model_dir, mode, chain_verify=True)
    assert set(single_chains) == {1} and single_rounds == no_rounds == 0
    assert max(chains) == SPARSE["gamma"]  # whole chains ran (all drafts of a round at once)
    # with chain_verify whole rounds ran as one plan (every draft, then the verification)
    assert rounds > 0
    assert rounded == chained == single == expected


@pytest.mark.parametrize("mode", ["magicdec", "aspire_fixed"])
def test_rounds_per_plan_give_the_tokens_of_one_round_per_plan(tiny_model_dir, mode):
    # several rounds in one plan (the worker starts each from the last one's accepted tokens;
    # the engine commits them in order, stops in any, frees pages after the last): same tokens
    model_dir = tiny_model_dir("llama")
    one, _, one_rounds = _run(model_dir, mode, rounds_per_plan=1)
    assert _run.most_rounds == 1
    several, _, rounds = _run(model_dir, mode, rounds_per_plan=3)
    assert _run.most_rounds == 3 and rounds < one_rounds  # fewer plans held the rounds
    assert several == one == _run(model_dir, "ar")[0]


@pytest.mark.parametrize("mode", ["magicdec", "aspire_fixed"])
def test_sampled_chains_draw_as_single_draft_steps(tiny_model_dir, mode):
    # seeded sampling: each draft drawn at its own (seed, position), its q kept for the
    # verification; the round's verification in the chain's plan (by the sampled rows'
    # choices, worker/sampled_rows.py), several rounds a plan, or a plan of its own
    model_dir = tiny_model_dir("llama")
    single, single_chains, _ = _run(model_dir, mode, temperature=0.8, draft_chains=False)
    chained, chains, no_rounds = _run(model_dir, mode, temperature=0.8, chain_verify=False)
    rounded, _, rounds = _run(model_dir, mode, temperature=0.8, rounds_per_plan=1)
    assert set(single_chains) == {1} and max(chains) == SPARSE["gamma"] and no_rounds == 0
    assert rounds > 0
    assert rounded == chained == single
    # several rounds a plan: a plan's later rounds draft gamma tokens whatever a request has
    # left, so its last tokens may come from another stream (an accepted draft where one plan
    # a round verified a capped round and drew the next token from p): the same before them
    several, _, _ = _run(model_dir, mode, temperature=0.8, rounds_per_plan=4)
    assert _run.most_rounds > 1
    tail = SPARSE["gamma"] + 1
    assert {k: v[:-tail] for k, v in several.items()} == {k: v[:-tail] for k, v in single.items()}
    assert all(len(v) == 24 for v in several.values())


def test_no_chains_per_request(tiny_model_dir):
    # one plan per step (its several steps a plan: tests/test_async_runs.py)
    _, per_request, per_request_rounds = _run(tiny_model_dir("llama"), "aspire", async_steps=1)
    assert set(per_request) == {1} and per_request_rounds == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_chains_give_the_tokens_of_single_steps(tiny_model_dir, temperature):
    # ar: several decode steps per plan, each step's token fed forward on the device (sampled
    # rows drawn at their own (seed, position) from the target's stream); stop conditions
    # applied after the chain: max_tokens 24 is not a multiple of the chain of 5
    model_dir = tiny_model_dir("llama")
    single, single_chains, _ = _run(model_dir, "ar", temperature=temperature, ar_chain=1)
    chained, chains, rounds = _run(model_dir, "ar", temperature=temperature, ar_chain=5)
    assert set(single_chains) == {1} and max(chains) == 5 and rounds == 0
    assert [len(tokens) for tokens in chained.values()] == [24] * 4
    assert chained == single


@pytest.mark.slow
def test_rounds_started_early_give_the_tokens_of_ar(tiny_model_dir):
    # greedy rounds on the (emulated) graphs: the next plan's first round replays before this
    # plan's tokens reach the host, and the next plan continues it on the device (requests
    # that finished in between stop in their places) or drops it: `ar`'s tokens either way.
    # Under the interpreter: 2 layers (magicdec's window scores no pages: no refresh layer to
    # put layers around) and short outputs (still 8 rounds started, 3 continued)
    model_dir = tiny_model_dir("llama_2l")
    cfg = build_engine_config(model_dir, spec_mode="magicdec", max_num_batched_tokens=64,
                              num_pages=120, max_num_seqs=4, attention_backend="triton",
                              rounds_per_plan=2, **SPARSE)  # fmt: skip
    engine = LLMEngine(cfg)
    w = use_eager_graphs(engine)
    prompts = random_prompts(4, [30, 100, 150], vocab=256, seed=5)
    params = [SamplingParams(max_tokens=14 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(4)]  # fmt: skip
    outs = run_staggered(engine, prompts, params, arrive_every=2)
    ar = LLMEngine(build_engine_config(model_dir, spec_mode="ar", num_pages=120))
    assert outs == run_staggered(ar, prompts, params, arrive_every=2)
    graphs = w.draft_graphs
    assert graphs.verify is not None and graphs.steps > 0
    assert graphs.rounds_continued >= 2, (graphs.rounds_started, graphs.rounds_continued)


@pytest.mark.slow
def test_decode_chains_started_early_give_the_tokens_of_single_steps(tiny_model_dir):
    # ar's greedy decode chains on the (emulated) graphs: the next chain replays before this
    # chain's tokens reach the host, and the next plan continues it on the device (requests
    # that finished in between stop in their places, new ones arriving drop it): the tokens
    # of one plan per step either way. Under the interpreter: 2 layers (ar scores no pages)
    # and short outputs (still 7 chains started, 4 continued)
    model_dir = tiny_model_dir("llama_2l")
    prompts = random_prompts(4, [30, 100, 150], vocab=256, seed=5)
    params = [SamplingParams(max_tokens=14 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(4)]  # fmt: skip

    def run():
        cfg = build_engine_config(model_dir, spec_mode="ar", max_num_batched_tokens=64,
                                  num_pages=120, max_num_seqs=4, attention_backend="triton",
                                  ar_chain=4, ar_overlap=True)  # fmt: skip
        engine = LLMEngine(cfg)
        w = use_eager_graphs(engine)
        return run_staggered(engine, prompts, params, arrive_every=2), w.draft_graphs

    overlapped, graphs = run()
    assert graphs.chains_continued >= 2, (graphs.chains_started, graphs.chains_continued)
    single = LLMEngine(build_engine_config(model_dir, spec_mode="ar", num_pages=120, ar_chain=1))
    assert overlapped == run_staggered(single, prompts, params, arrive_every=2)


@pytest.mark.parametrize("mode", ["specattn", "aspire_fixed"])
def test_a_request_near_its_end_keeps_the_batchs_round(tiny_model_dir, mode):
    # requests of different max_tokens in one synchronized batch: one near its limit drafts
    # the round's length all the same (the commit drops what passes the limit), so that every
    # decode plan is a whole round, chain and verification; capped to its last tokens, it
    # split the batch's round into chains without a verification, off the round graphs
    # (docs/benchmarks.md §8.60). Tokens: `ar`'s, each request exactly its max_tokens.
    lengths = [7, 11, 13, 23]

    def run(spec_mode):
        cfg = build_engine_config(tiny_model_dir("llama"), spec_mode=spec_mode,
                                  max_num_batched_tokens=64, num_pages=120, calibrate="off",
                                  **SPARSE)  # fmt: skip
        engine = LLMEngine(cfg)
        for i, (prompt, n) in enumerate(zip(random_prompts(4, [40, 60], vocab=256, seed=3),
                                            lengths, strict=True)):  # fmt: skip
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=n, temperature=0.0,
                                                              ignore_eos=True))  # fmt: skip
        engine.scheduler.pause_decoding = True  # every prompt first: one batch from then on
        while any(r.in_prefill or r.num_computed == 0 for r in engine.requests.values()):
            engine.step()
        engine.scheduler.pause_decoding = False
        before = dict(engine.step_kinds)
        outs = {}
        while engine.has_unfinished():
            outs.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        kinds = {k: v - before.get(k, 0) for k, v in engine.step_kinds.items()}
        return [outs[str(i)] for i in range(4)], kinds

    expected, _ = run("ar")
    out, kinds = run(mode)
    assert out == expected and [len(t) for t in out] == lengths
    assert kinds.get("round", 0) > 0 and not kinds.get("draft") and not kinds.get("verify"), kinds
