"""Draft-step graphs (``worker/draft_graphs.py``): a chain's draft steps planned on the device
give the drafts of the host-planned steps, token for token (seeded sampling: the same draws,
q kept for the verification), and the engine's output stays that of the host-planned run.
CPU: Triton's interpreter, graphs emulated by re-running the captured step (EagerGraph), so
the device planning, the fixed buffers and bucket padding are what is tested.
"""

from __future__ import annotations

import pytest
from helpers import random_prompts, run_staggered, use_eager_graphs

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config
from aspire_ray.plan import RowKind

SPARSE = dict(k_min=3, recent_pages=1, rho=0.07, gamma=4, d_max=6)


def _run(model_dir, mode, draft_graphs: bool, page_size: int = 4, greedy: bool = False,
         max_num_seqs: int = 4, graph_tokens: int = 32, **spec):
    cfg = build_engine_config(model_dir, spec_mode=mode, max_num_batched_tokens=64,
                              num_pages=120, attention_backend="triton",
                              max_num_seqs=max_num_seqs, page_size=page_size,
                              **{**SPARSE, **spec})  # fmt: skip
    engine = LLMEngine(cfg)
    # 32 tokens: a round's verification of 4 rows of 5 queries fits a bucket
    w = use_eager_graphs(engine, draft_graphs, graph_tokens=graph_tokens)
    drafts = []
    execute = w.execute

    def recording(plan):
        out = execute(plan)
        drafts.extend((r.req_id, tuple(r.tokens)) for r in out.results
                      if r.kind == RowKind.DRAFT or len(r.tokens) > 1)  # drafts; decode chains
        # a pending q owns its own [V] row only (not a view of a step's [S, V] gather)
        assert all(q.untyped_storage().nbytes() == q.numel() * q.element_size()
                   for req in w.requests.values() for q in req.draft_probs)  # fmt: skip
        return out

    w.execute = recording
    # 4-token pages: rows of 3 to 14 pages, so the budget (3 pages) cuts most of them
    prompts = random_prompts(4, [8, 24, 40], vocab=256, seed=4)
    # sampled (seeded, top-p): the graph variant that draws (greedy ones run on the GPU:
    # test_gpu_engine.py); the same draws as the host-planned steps
    # (7 tokens, the interpreter: still 14 chain steps on the graphs with aspire_fixed)
    params = [SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(4)]  # fmt: skip
    if greedy:  # (10 to 13 tokens: still 6 verifications replayed, 39 drafts compared)
        params = [SamplingParams(max_tokens=10 + i, temperature=0.0, ignore_eos=True)
                  for i in range(4)]  # fmt: skip
    return run_staggered(engine, prompts, params, arrive_every=2), drafts, w


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["aspire_fixed", "ar"])
def test_chain_graphs_run_as_planned_steps(tiny_model_dir, mode):
    # aspire_fixed: top-k pages chosen from scores, the refresh layer rescoring every step;
    # magicdec and specattn (subsets of it) run on the GPU (test_gpu_engine.py), sampling too.
    # ar: decode chains on the same graphs (every page listed, the target's random stream)
    # interpreted kernels: 3 layers (aspire_fixed: around its refresh layer), 2 for ar
    model_dir = tiny_model_dir("llama_2l" if mode == "ar" else "llama_3l")
    # sampled rounds verify in their plan, on a graph too (worker/sampled_rows.py); no round
    # started early: a dropped one leaves page scores behind, later drafts may differ, and
    # with them sampled tokens (their distribution does not: tests/test_sampling.py)
    expected, planned, _ = _run(model_dir, mode, draft_graphs=False, rounds_overlap=False)
    got, drafted, w = _run(model_dir, mode, draft_graphs=True, rounds_overlap=False)
    assert w.draft_graphs.steps > 10, "too few chain steps replayed by the chain graphs"
    assert drafted == planned and len(planned) > 3  # the same tokens, chain by chain
    assert got == expected
    assert any(variant is not None for _, variant in w.draft_graphs.graphs)  # graphs that draw
    if mode == "aspire_fixed":  # sampled verifications replayed by their graph variant
        assert any(v is not None for _, _, v in w.draft_graphs.verify.graphs)
        assert w.draft_graphs.verify.steps >= 3


@pytest.mark.slow
def test_round_graphs_verify_as_planned_steps(tiny_model_dir):
    # greedy rounds: the chain's verification replayed by a graph that plans itself, rounds
    # back to back on the device (two per plan); aspire_fixed: the verification also rescores
    # the pages from each row's first and last query (magicdec's, without scores, a subset)
    mode = "aspire_fixed"
    model_dir = tiny_model_dir("llama_3l")
    expected, planned, _ = _run(model_dir, mode, draft_graphs=False, greedy=True,
                                rounds_per_plan=2)  # fmt: skip
    # no round started early: a dropped one leaves page scores behind, and later drafts may
    # differ (the tokens do not: test_draft_chains.py::test_rounds_started_early_...)
    got, drafted, w = _run(model_dir, mode, draft_graphs=True, greedy=True, rounds_per_plan=2,
                           rounds_overlap=False)  # fmt: skip
    assert w.draft_graphs.verify.steps > 4, "too few verifications replayed by the graphs"
    assert drafted == planned and len(planned) > 3  # the same drafts, round by round
    assert got == expected


@pytest.mark.slow
def test_a_full_batch_verifies_on_graphs_where_its_rows_fit(tiny_model_dir, monkeypatch):
    # max_num_seqs 3, 16-token graphs: a round's verification of 3 rows of 5 queries (15
    # tokens) replays the graph of 3 rows; padded to 4 rows (20 tokens) it had no bucket, and
    # every verification of a full batch was planned on the host (specattn/g8 at 32k x 160 on
    # an H100: 8.6% of the GPU idle, docs/benchmarks.md §8.58)
    from aspire_ray.worker.verify_graphs import VerifyGraphs

    replayed, replay = [], VerifyGraphs.replay

    def recording(self, n, q, variant=None):
        replayed.append(n)
        return replay(self, n, q, variant)

    monkeypatch.setattr(VerifyGraphs, "replay", recording)
    model_dir = tiny_model_dir("llama_3l")
    run = dict(greedy=True, max_num_seqs=3, graph_tokens=16, rounds_per_plan=2)
    expected, planned, _ = _run(model_dir, "aspire_fixed", draft_graphs=False, **run)
    got, drafted, w = _run(model_dir, "aspire_fixed", draft_graphs=True, rounds_overlap=False,
                           **run)  # fmt: skip
    assert w.draft_graphs.buckets == [1, 2, 3]
    assert replayed.count(3) >= 2, replayed  # verifications of 3 rows on the graphs
    assert drafted == planned and got == expected


def test_sampled_verifications_are_captured_up_front_over_one_q_store(tiny_model_dir):
    # sampled_graphs_at_start: each bucket's round verification is captured at start-up in
    # every sampling variant too; every bucket's q_round is a view of one store
    from aspire_ray.worker.draft_graphs import SAMPLED_VARIANTS

    cfg = build_engine_config(tiny_model_dir("llama_3l"), spec_mode="aspire_fixed",
                              max_num_batched_tokens=64, num_pages=120, max_num_seqs=4,
                              page_size=4, calibrate="off", **SPARSE)  # fmt: skip
    engine = LLMEngine(cfg)
    d = use_eager_graphs(engine).draft_graphs
    q = cfg.spec.gamma + 1
    d.capture_all(engine.executor.worker.kv_caches, verify_steps=cfg.spec.gamma, sampled=True)
    verified = {n for n, _, _ in d.verify.graphs}
    assert verified and {(n, q, v) for n in verified for v in [None, *SAMPLED_VARIANTS]} \
        == set(d.verify.graphs)  # fmt: skip
    store = d.rounds_q.data[0]
    # a fixed-gamma chain is at most gamma long: the store keeps gamma planes, not d_max's
    assert d.max_steps == cfg.spec.gamma < cfg.spec.d_max and store.shape[0] == cfg.spec.gamma
    assert set(d.q_round) == verified
    assert all(d.q_round[n].data_ptr() == store.data_ptr() for n in verified)
