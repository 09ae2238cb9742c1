"""Asynchronous runs (``RowPlan.async_gamma``: aspire's steps several to a plan, each request
drafting until it holds its draft length, then verifying): the row kinds follow the drafts
held; greedy output equals ``ar``'s token for token, with the steps planned on the host and
with the self-planning graphs (``worker/async_graphs.py``; CPU: Triton's interpreter, graphs
emulated by EagerGraph), and the graphs draft and verify what the host-planned steps do."""

from __future__ import annotations

import pytest
import torch
from fake_executor import FakeExecutor
from helpers import random_prompts, run_staggered, use_eager_graphs

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.engine.request import Status
from aspire_ray.llm import build_engine_config
from aspire_ray.plan import RowKind, RowPlan, async_kinds, held_after
from aspire_ray.worker.async_runs import AsyncTrack, Started

SPARSE = dict(k_min=3, recent_pages=1, rho=0.07, gamma=4, d_max=6, gamma_init=3)


def test_async_kinds_follow_the_drafts_held():
    row = RowPlan("a", RowKind.DRAFT, [7], 11, 0, [], num_steps=9, verify_after=[5, 6, 7],
                  async_gamma=3)  # fmt: skip
    # holds 2 drafts: one more, then verify 3; then 3 drafts and verify them; then a draft
    assert row.async_kinds() == [-1, 3, -1, -1, -1, 3, -1, -1, -1]
    row.async_gamma = 0  # plain decoding: every step verifies no draft
    assert RowPlan("a", RowKind.DRAFT, [5], 9, 0, [], num_steps=3, verify_after=[5],
                   async_gamma=0).async_kinds() == [0, 0, 0]
    # more drafts held than the length: verify them first
    assert RowPlan("a", RowKind.DRAFT, [7], 11, 0, [], num_steps=2, verify_after=[5, 6, 7],
                   async_gamma=1).async_kinds() == [2, -1]


def _engine(model_dir, mode, **spec):
    base = dict(max_num_batched_tokens=64, num_pages=120, max_num_seqs=4, page_size=4,
                calibrate="off")  # fmt: skip
    return LLMEngine(build_engine_config(model_dir, spec_mode=mode, **{**base, **SPARSE, **spec}))


def _greedy(engine, n=4, max_tokens=20):
    prompts = random_prompts(n, [8, 24, 40], vocab=256, seed=4)
    params = [SamplingParams(max_tokens=max_tokens + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(n)]  # fmt: skip
    return run_staggered(engine, prompts, params, arrive_every=2)


def _recording(worker):
    """Record the plans' asynchronous rows' segments: (req, drafts, verified tokens)."""
    segments, execute = [], worker.execute

    def recording(plan):
        out = execute(plan)
        for row, res in zip(plan.rows, out.results, strict=True):
            if row.async_gamma is not None:
                segments.extend((res.req_id, tuple(seg.tokens),
                                 seg.verified and tuple(seg.verified.tokens))
                                for seg in (res, *res.rounds))  # fmt: skip
        return out

    worker.execute = recording
    return segments


@pytest.mark.parametrize("mode", ["aspire", "aspire_fsm"])
def test_async_runs_match_ar(tiny_model_dir, mode):
    model_dir = tiny_model_dir("llama")
    expected = _greedy(_engine(model_dir, "ar"))
    engine = _engine(model_dir, mode, async_steps=6)
    segments = _recording(engine.executor.worker)
    assert _greedy(engine) == expected
    kinds = engine.stats()["step_kinds"]
    assert kinds.get("async", 0) >= 12, kinds  # most steps ran in asynchronous runs
    assert any(tokens for _, tokens, _ in segments), "no run drafted"
    assert any(verified for _, _, verified in segments), "no run verified"


def _mixed(engine, max_tokens=20):
    """Greedy requests (r0, r2) beside sampled ones (r1 with top-p, r3), staggered."""
    prompts = random_prompts(4, [8, 24, 40], vocab=256, seed=4)
    params = [SamplingParams(max_tokens=max_tokens + 3 * i, temperature=0.8 * (i % 2), seed=i,
                             top_p=0.9 if i == 1 else 1.0, ignore_eos=True)
              for i in range(4)]  # fmt: skip
    return run_staggered(engine, prompts, params, arrive_every=2)


def test_sampled_requests_run_asynchronously(tiny_model_dir):
    # sampled rows beside greedy ones in the runs (worker/sampled_rows.py); the greedy
    # requests' tokens are still `ar`'s
    model_dir = tiny_model_dir("llama")
    expected = _mixed(_engine(model_dir, "ar"))
    engine = _engine(model_dir, "aspire", async_steps=6)
    segments = _recording(engine.executor.worker)
    out = _mixed(engine)
    assert engine.stats()["step_kinds"].get("async", 0) >= 12, engine.stats()["step_kinds"]
    assert (out["r0"], out["r2"]) == (expected["r0"], expected["r2"])
    sampled = [v for rid, _, v in segments if rid in ("r1", "r3") and v]
    assert len(sampled) >= 4, "too few sampled verifications in the runs"


@pytest.mark.slow
@pytest.mark.parametrize("refresh", [True, False], ids=["refresh", "norefresh"])
def test_async_graphs_run_as_planned_steps(tiny_model_dir, refresh):
    # aspire: top-k pages chosen from scores; every row rescores at the refresh layer (draft
    # rows from their query, verify rows from their first and last); ragged rows' attention
    # work planned on the device. norefresh (SpecConfig.draft_refresh False): the refresh
    # layer over the step's own lists, verify rows alone rescoring
    model_dir = tiny_model_dir("llama_3l")  # 3 layers: interpreted kernels, a layer fewer
    # ... with no run started early (a started run that is dropped leaves its page scores
    # behind, and later drafts may differ; the tokens do not: the test below)
    opts = dict(async_steps=6, attention_backend="triton", async_overlap_steps=0,
                draft_refresh=refresh)  # fmt: skip
    planned = _engine(model_dir, "aspire", **opts)
    use_eager_graphs(planned, draft_graphs=False)
    on_host = _recording(planned.executor.worker)
    # short outputs (the interpreter): still 34 steps on the graphs, 42 segments compared
    expected = _greedy(planned, max_tokens=7)
    engine = _engine(model_dir, "aspire", **opts)
    w = use_eager_graphs(engine)
    on_graphs = _recording(w)
    assert _greedy(engine, max_tokens=7) == expected
    assert w.async_graphs.steps >= 12, "too few steps replayed by the asynchronous graphs"
    assert on_graphs == on_host and len(on_host) > 6  # the same drafts and verifications
    # the steps of draft rows only replayed their lean graphs (one query tile; norefresh: no
    # rescoring), with the same drafts as the host's steps, which rescore every verify row
    lean = w.async_graphs.lean_steps
    assert 0 < lean < w.async_graphs.steps, lean


@pytest.mark.slow
def test_sampled_async_graphs_run_as_planned_steps(tiny_model_dir):
    # sampled rows on the graphs (their q kept on the device between steps, the acceptance
    # and the draws there) give the host-planned steps' drafts, verifications and tokens; the
    # next run's first steps start before the host knows this run's (async_overlap_steps 2,
    # both engines: the scheduler promises the same draft lengths), from the q left on the
    # device, while the q of the drafts held at the run's end are read from their snapshot.
    # (A started run that is dropped leaves its page scores behind, which may change later
    # drafts and so sampled tokens in general; not in this run, which the test fixes.)
    model_dir = tiny_model_dir("llama_3l")
    spec = dict(async_steps=6, attention_backend="triton", async_overlap_steps=2)
    planned = _engine(model_dir, "aspire", **spec)
    use_eager_graphs(planned, draft_graphs=False)
    on_host = _recording(planned.executor.worker)
    expected = _mixed(planned, max_tokens=20)
    engine = _engine(model_dir, "aspire", **spec)
    w = use_eager_graphs(engine)
    on_graphs = _recording(w)
    assert _mixed(engine, max_tokens=20) == expected
    graphs = w.async_graphs
    assert graphs.steps >= 12, "too few steps replayed by the asynchronous graphs"
    assert any(v is not None for _, _, v, _ in graphs.graphs), "no sampled graph variant ran"
    assert graphs.runs_continued >= 2, (graphs.runs_started, graphs.runs_continued)
    assert on_graphs == on_host and len(on_host) > 6
    # the q read after a run are the snapshot's, whatever the steps started since wrote
    with torch.inference_mode():  # the worker's tensors
        kept = graphs.q_store[graphs.loaded][:2, 0].clone()
        graphs.snapshot_q(2)
        graphs.q_store[graphs.loaded].fill_(-1.0)
        pending = graphs.pending_q(0, 2)
    assert all(torch.equal(q, k) for q, k in zip(pending, kept, strict=True))


# ---- zero-bubble runs (SpecConfig.async_overlap_steps) ---------------------------------------
def test_held_after_and_kinds_of_the_next_run():
    kinds = async_kinds(2, 3, 6)  # one draft, verify 3, three drafts, verify 3
    assert kinds == [-1, 3, -1, -1, -1, 3] and held_after(kinds, 2) == 0
    assert held_after(async_kinds(0, 4, 7), 0) == 2  # four drafts, verify, two drafts
    assert held_after([], 5) == 5


def _result_tuple(res):
    out = [(res.tokens, res.verified and (res.verified.tokens, res.verified.num_accepted))]
    return out + [_result_tuple(r) for r in res.rounds]


@pytest.mark.parametrize("seed", range(6))
def test_a_whole_run_taken_at_once_is_the_steps_taken_one_by_one(seed):
    # AsyncTrack.take_run (the graphs' path: one call a row) against take at every step, on
    # the flat step-major layout of several rows whose argmax often matches their drafts
    import random

    import numpy as np

    rng = random.Random(seed)
    steps = rng.choice([1, 5, 16])
    rows = [RowPlan(f"r{i}", RowKind.DRAFT, [7], 100 + i, 0, [],
                    verify_after=[7] + [rng.randrange(3) for _ in range(rng.randrange(3))],
                    num_steps=steps, async_gamma=rng.randrange(1, 5)) for i in range(4)]
    by_step, by_run = [AsyncTrack(r) for r in rows], [AsyncTrack(r) for r in rows]
    layout = [[t.queries(s) for t in by_step] for s in range(steps)]
    flat = [rng.randrange(3) for _ in range(sum(map(sum, layout)))]
    at = 0
    for s in range(steps):
        for t, q in zip(by_step, layout[s], strict=True):
            t.take(s, flat[at : at + q])
            at += q
    counts = np.asarray(layout, dtype=np.int64)
    starts = (np.cumsum(counts) - counts.ravel()).reshape(counts.shape)
    for r, t in enumerate(by_run):
        t.take_run(np.asarray(flat, dtype=np.int64), starts[:, r])
    for a, b in zip(by_step, by_run, strict=True):
        assert (a.known, a.x_pos, a.visible) == (b.known, b.x_pos, b.visible)
        assert _result_tuple(a.result()) == _result_tuple(b.result())


def _async_plans(engine):
    """Record each asynchronous plan's rows."""
    plans, execute = [], engine.executor.execute

    def recording(plan):
        if plan.rows and plan.rows[0].async_gamma is not None:
            plans.append({row.req_id: row for row in plan.rows})
        return execute(plan)

    engine.executor.execute = recording
    return plans


@pytest.mark.parametrize("overlap", [0, 4])
def test_a_run_keeps_the_draft_lengths_the_last_one_promised(overlap):
    # no verify slots: every run 6 steps, and the fresh choice is the promise (slots align the
    # two to different steps; tests/test_verify_slots.py keeps promises with slots)
    cfg = build_engine_config("dummy", load_format="dummy", spec_mode="aspire", calibrate="off",
                              async_steps=6, async_overlap_steps=overlap,
                              verify_quantum=1)  # fmt: skip
    fake = FakeExecutor(cfg)
    engine = LLMEngine(cfg, executor=fake)
    plans = _async_plans(engine)
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [(5 * i + j) % 256 for j in range(200 + 40 * i)], params)
    ps = cfg.cache.page_size
    checked = 0
    while engine.has_unfinished():
        runs = len(plans)
        engine.step()
        if len(plans) > runs:  # after a run: the pages the next run's first steps may use
            for rid, row in plans[-1].items():
                req = engine.requests.get(rid)
                if req is not None and req.status == Status.RUNNING:
                    assert len(fake.tables[rid]) * ps >= row.final_context_len + overlap
                    checked += 1
    assert checked > 10
    kept = 0
    for before, after in zip(plans, plans[1:], strict=False):
        for rid, row in after.items():
            if rid in before and row.num_steps == 6:
                if overlap:  # this run's draft length: the last run's promise
                    assert row.async_gamma == before[rid].next_async_gamma
                kept += 1
    assert kept > 10
    if not overlap:  # nothing started early: each run takes its fresh draft length
        assert all(r.async_gamma == r.next_async_gamma for p in plans for r in p.values())


def test_a_started_run_continues_only_as_started():
    row = RowPlan("a", RowKind.DRAFT, [7], 11, 4, [], num_steps=6, verify_after=[5, 6, 7],
                  async_gamma=3)  # fmt: skip
    track = AsyncTrack(row)
    started = Started(8, ["a", "b", None], {"a": 3, "b": 2}, 6, {"a": track.kinds, "b": []},
                      [[1, 1, 0], [1, 3, 0]], [])  # fmt: skip
    started.learn_starts([track], page_size=4)  # two steps: KV at positions 11 and 12
    assert started.starts == {"a": ([5, 6, 7], 11)} and started.pages == {"a": 4}
    assert started.mismatch([row], [track]) is None  # "b" stopped: "a" continues in its place

    def variant(**kw):
        r = RowPlan(**{**row.__dict__, **kw})
        return started.mismatch([r], [AsyncTrack(r)])

    assert variant(async_gamma=2) == "gamma"  # another draft length
    assert variant(num_steps=5) == "steps"  # another length
    assert variant(pages_keep=3) == "pages"  # a page the started steps used was replaced
    assert variant(start_pos=12, verify_after=[5, 6, 7, 8]) == "start"  # other tokens known
    assert variant(req_id="c") == "row"  # a row that was not started
    started.starts.clear()  # the last run's tokens were never taken
    assert started.mismatch([row], [track]) == "row"


@pytest.mark.slow
def test_runs_started_early_give_the_same_tokens(tiny_model_dir):
    # the next run's first steps start before the current run's tokens are known; requests
    # that finish in between drop out of the started run (staggered lengths), the others
    # continue it on the device: the output is `ar`'s. With verify slots the first run is
    # shorter (it ends on the slot cycle) and promises the next one's length: quantum 4 turns
    # the 6-step runs into 4-step ones after a first of 4 or fewer
    model_dir = tiny_model_dir("llama_3l")  # 3 layers: interpreted kernels, a layer fewer
    # 20 to 29 tokens (the interpreter; 30 to 39 took half as long again): still 12 runs
    # started and 3 continued, one with a drafting row and one after a request dropped out
    expected = _greedy(_engine(model_dir, "ar"), max_tokens=20)
    engine = _engine(model_dir, "aspire", async_steps=6, attention_backend="triton",
                     async_overlap_steps=2, verify_quantum=4)  # fmt: skip
    w = use_eager_graphs(engine)
    assert _greedy(engine, max_tokens=20) == expected
    graphs = w.async_graphs
    assert graphs.runs_started >= 4 and graphs.runs_continued >= 2, \
        (graphs.runs_started, graphs.runs_continued)  # fmt: skip
    # every other started run was dropped for a reason, bar one started after the last plan
    dropped = sum(graphs.runs_dropped.values())
    assert graphs.runs_started - graphs.runs_continued - dropped in (0, 1), graphs.runs_dropped
    print("dropped:", dict(graphs.runs_dropped))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["aspire", "aspire_fixed"])
def test_finer_token_buckets_keep_ars_tokens(tiny_model_dir, monkeypatch, mode):
    # graph_buckets_per_octave 4 (from 4 tokens here, 128 on a real shape): the asynchronous
    # steps and the rounds' verifications replay graphs of 5, 6, 7, 10, ... tokens (the
    # dense layers over fewer padding tokens); their tokens are `ar`'s
    from aspire_ray.worker import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "FINE_BUCKETS_FROM", 4)
    model_dir = tiny_model_dir("llama_3l")  # 3 layers: interpreted kernels, a layer fewer
    expected = _greedy(_engine(model_dir, "ar"), max_tokens=12)
    engine = _engine(model_dir, mode, async_steps=6, attention_backend="triton",
                     graph_buckets_per_octave=4)  # fmt: skip
    w = use_eager_graphs(engine)
    assert _greedy(engine, max_tokens=12) == expected
    if mode == "aspire":  # (rows, tokens, ...)
        tokens = [t for _, t, *_ in w.async_graphs.graphs]
    else:  # (rows, queries a row, ...)
        tokens = [w.graphs.bucket(n * q) for n, q, _ in w.draft_graphs.verify.graphs]
    assert any(t & (t - 1) for t in tokens), f"no fine token bucket replayed: {tokens}"


@pytest.mark.slow
def test_a_full_batch_of_max_num_seqs_rows_pads_to_no_more(tiny_model_dir):
    # max_num_seqs 3: row buckets 1, 2, 3 (not 4: a full batch's padded rows once made its
    # verifications overflow the largest token bucket, docs/benchmarks.md §8.58); runs of 3
    # rows replay graphs of 3 rows, their lean steps in the 4-token bucket; ar's tokens
    model_dir = tiny_model_dir("llama_3l")
    expected = _greedy(_engine(model_dir, "ar", max_num_seqs=3), n=3, max_tokens=20)
    engine = _engine(model_dir, "aspire", async_steps=6, attention_backend="triton",
                     max_num_seqs=3)  # fmt: skip
    graphs = use_eager_graphs(engine).async_graphs
    assert graphs.row_buckets == [1, 2, 3]
    replayed, replay = [], graphs.replay

    def recording(n, layout):
        replayed.append((n, max(map(sum, layout))))
        return replay(n, layout)

    graphs.replay = recording
    assert _greedy(engine, n=3, max_tokens=20) == expected
    assert any(n == 3 and t > 3 for n, t in replayed), replayed  # verify rows among 3
    assert (3, 4, None, True) in graphs.graphs  # the lean graph, captured up front


def test_every_row_bucket_is_captured_up_front(tiny_model_dir):
    # a batch shrinks as its requests finish: each smaller row bucket's graphs are captured at
    # start-up, not inside a running batch's steps (with their kernels' compiles on a GPU)
    engine = _engine(tiny_model_dir("llama"), "aspire", async_steps=6)
    graphs = use_eager_graphs(engine).async_graphs
    graphs.capture_all(3, engine.executor.worker.kv_caches)
    assert {n for n, _, _, _ in graphs.graphs} == {b for b in graphs.row_buckets if b <= 4}
    # up to the token bucket of a full bucket's rows verifying max_q queries each: 4 x 7 = 28
    # tokens fill the 32 bucket, which a run's step may reach (it was captured on first use)
    assert graphs.max_q == 7
    assert all(n <= t <= graphs.pieces.bucket(n * graphs.max_q) and v is None
               for n, t, v, _ in graphs.graphs)  # fmt: skip
    assert {t for n, t, _, _ in graphs.graphs if n == 4} == {4, 8, 16, 32}
    # with or without the refresh, each row bucket's lean graph too, for the steps of draft
    # rows only (a query a row: n tokens); their attention is one launch of one query's tile,
    # not a second, empty one for verify rows' wide tile (4 query heads a KV head: 16- and
    # 32-row tiles)
    for refresh in (True, False):
        engine = _engine(tiny_model_dir("llama_3l"), "aspire", async_steps=6,
                         draft_refresh=refresh)  # fmt: skip
        graphs = use_eager_graphs(engine).async_graphs
        graphs.capture_all(3, engine.executor.worker.kv_caches)
        lean = {(n, t) for n, t, _, x in graphs.graphs if x}
        assert lean == {(n, n) for n in graphs.row_buckets if n <= 4}
        # ... and a step of more queries than rows (a row verifies drafts: every row takes
        # the wide tile, mixed_one_launch) one launch of that tile; only a step of as many
        # queries as rows that is not lean (a row of draft length 0 verifying) needs both
        launches = {"lean": set(), "t = n": set(), "t > n": set()}
        for (n, t, _, lean), plan in graphs.plans.items():
            kind = "lean" if lean else "t = n" if t == n else "t > n"
            launches[kind].add(tuple(launch.block_m for launch in plan.plan.launches))
        assert launches == {"lean": {(16,)}, "t = n": {(16, 32)}, "t > n": {(32,)}}, launches


def test_a_lean_step_holds_draft_rows_only():
    # a step's lean graph (one query tile; without the refresh no rescoring) only where no
    # row verifies: every row one query at most, and without the refresh no live row of draft
    # length 0 (it verifies at every step, with one query, and must rescore)
    from types import SimpleNamespace

    from aspire_ray.worker.async_graphs import AsyncStepGraphs

    def lean(queries, gammas, live, on=True, refresh=False):
        graphs = SimpleNamespace(lean=on, skips_rescoring=not refresh)
        AsyncStepGraphs._set_gammas(graphs, gammas, live)
        return AsyncStepGraphs.lean_step(graphs, queries)

    assert lean([1, 1, 0], [3, 5, 0], [True, True, False])  # a padding row of length 0
    assert not lean([1, 4, 1], [3, 3, 5], [True] * 3)  # a verification of 3 drafts
    assert not lean([1, 1], [0, 3], [True, True])  # a live row of draft length 0 ...
    assert lean([1, 1], [0, 3], [True, True], refresh=True)  # ... rescored there
    assert lean([0, 1], [0, 3], [False, True])  # ... stopped
    assert not lean([1, 1], [3, 3], [True, True], on=False)  # lean steps off (nolean)


def test_sampled_variants_are_captured_up_front_over_one_q_store(tiny_model_dir):
    # with sampled_graphs_at_start (the worker's warm-up) every sampling variant is captured
    # beside the greedy graphs, so a sampled run captures nothing inside a batch's steps; every
    # row bucket's q store is a view of one store (and one snapshot), not a store of its own
    from aspire_ray.worker.draft_graphs import SAMPLED_VARIANTS

    engine = _engine(tiny_model_dir("llama"), "aspire", async_steps=6)
    graphs = use_eager_graphs(engine).async_graphs
    graphs.capture_all(4, engine.executor.worker.kv_caches, sampled=True)
    greedy = {(n, t) for n, t, v, _ in graphs.graphs if v is None}
    assert {(n, t, v, False) for n, t in greedy for v in SAMPLED_VARIANTS} < set(graphs.graphs)
    store, snap = graphs.rows_q.data
    for n in graphs.q_store:
        assert graphs.q_store[n].data_ptr() == store.data_ptr() and graphs.q_store[n].shape[1] == n
        assert graphs.q_snap[n].data_ptr() == snap.data_ptr()
    captured = set(graphs.graphs)
    out = _mixed(engine, max_tokens=12)
    assert set(graphs.graphs) == captured, "a sampled run captured a graph"
    assert graphs.steps >= 12 and [len(t) for t in out.values()] == [12, 15, 18, 21]


def test_a_sampled_run_needs_room_for_its_q_store(tiny_model_dir, monkeypatch):
    # the store of the drafts' q is made at a bucket's first sampled run, after the KV pool
    # took its share: where it would not fit, the run is planned on the host (no OOM)
    from aspire_ray.worker import device_memory

    engine = _engine(tiny_model_dir("llama"), "aspire", async_steps=6)
    graphs = use_eager_graphs(engine).async_graphs
    layout = [[1, 1], [2, 1]]
    assert graphs.fits(2, layout, sampled=True)
    monkeypatch.setattr(device_memory, "free_device_bytes",
                        lambda device: graphs.rows_q.nbytes)  # fmt: skip
    assert graphs.fits(2, layout) and not graphs.fits(2, layout, sampled=True)
    out = _mixed(engine, max_tokens=6)  # host-planned sampled runs
    assert all(v is None for _, _, v, _ in graphs.graphs), "a sampled graph variant was captured"
    assert engine.stats()["step_kinds"].get("async", 0) >= 6
    assert [len(t) for t in out.values()] == [6, 9, 12, 15]


@pytest.mark.slow
def test_a_wide_query_tile_keeps_ars_tokens_on_the_graphs(tiny_model_dir):
    # bench variant m128 (block_m_max 128): the policy's query tile follows the backend's
    # (ShardInfo.query_tile_tokens), the self-planning graphs plan verify rows in the wider
    # tile, and the tokens stay `ar`'s
    model_dir = tiny_model_dir("llama_3l")
    opts = dict(attention_backend="triton", attention_options={"block_m_max": 128})
    expected = _greedy(_engine(model_dir, "ar", **opts), max_tokens=7)
    engine = _engine(model_dir, "aspire", async_steps=6, **opts)
    w = use_eager_graphs(engine)
    assert _greedy(engine, max_tokens=7) == expected
    assert w.async_graphs.steps >= 12
    group = w.arch.num_heads // w.arch.num_kv_heads
    assert engine.policy.kv_reads.query_tile == 128 // group
