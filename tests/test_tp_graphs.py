"""Tensor parallelism on the graphs (issue 17 items 1-2): the self-planning graphs of the
asynchronous runs and of the synchronized rounds (device-planned page lists, top-k page choice,
the refresh layer's scoring, greedy acceptance), at TP=2 with their collectives inside, give
TP=1's tokens for the same plans, and both ranks hold the same page scores after every plan,
so they choose the same pages.

CPU: gloo, Triton's interpreter, graphs emulated by re-running each captured step
(EagerGraph), so what runs is the captured code with its all-reduces, not a separate eager
path. The TP=1 engine's plans (recorded) are replayed on two shard Workers in two processes:
in fp32 TP=2 commits TP=1's tokens, so TP=1's plans are the ones TP=2's driver would send.
NCCL capture itself needs two GPUs (``scripts/bench_tp.py``, ``tp_cuda_graphs``).
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
from helpers import eager_graphs_on, random_prompts, run_staggered, use_eager_graphs

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config

SPARSE = dict(k_min=3, recent_pages=1, rho=0.07, gamma=3, d_max=5, gamma_init=3)


def _cfg(model_dir, mode):
    return build_engine_config(model_dir, spec_mode=mode, max_num_batched_tokens=64,
                               num_pages=120, max_num_seqs=4, page_size=4, calibrate="off",
                               async_steps=6, **SPARSE)  # fmt: skip


def _tokens(out) -> list:
    """A step's results as plain data: each row's drafts and verified tokens, round by round."""
    return [(res.req_id, seg.kind.value, tuple(seg.tokens),
             seg.verified and tuple(seg.verified.tokens))
            for res in out.results for seg in (res, *res.rounds)]  # fmt: skip


def _shard(rank: int, cfg, plans, store_path: str, results) -> None:
    """One TP=2 rank: a Worker on the emulated graphs runs the recorded plans."""
    import torch
    import torch.distributed as dist

    from aspire_ray.tp import TPGroup
    from aspire_ray.worker.worker import Worker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        w = eager_graphs_on(Worker(cfg, tp=TPGroup(rank, 2, dist.group.WORLD), device="cpu"))
        outs, scores = [], []
        for plan in plans:
            outs.append(_tokens(w.execute(plan)))
            scores.append(w.scores.scores.clone())
        counters = w.graph_counters()
        # numpy, pickled by value: a tensor would cross as shared memory that this process
        # must keep alive until the parent has read it
        results.put((rank, outs, torch.stack(scores).numpy() if scores else None, counters))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("mode,temperature", [("aspire", 0.0), ("aspire_fixed", 0.0),
                                              ("aspire", 0.8), ("aspire_fixed", 0.8)])
def test_tp2_graphs_replay_tp1(tiny_model_dir, tmp_path, mode, temperature):
    # 4 q heads, 1 kv head: each rank holds 2 q heads (their max over ranks picks the pages)
    # and the kv head; 3 layers put layers before, at and after the refresh layer
    model_dir = tiny_model_dir("llama_3l")
    cfg = _cfg(model_dir, mode)
    engine = LLMEngine(cfg)
    w = use_eager_graphs(engine)
    plans, expected, execute = [], [], w.execute

    def recording(plan):
        out = execute(plan)
        plans.append(plan)
        expected.append(_tokens(out))
        return out

    w.execute = recording
    prompts = random_prompts(3, [8, 24, 40], vocab=256, seed=4)
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=temperature, seed=i,
                             ignore_eos=True) for i in range(3)]  # fmt: skip
    run_staggered(engine, prompts, params, arrive_every=2)

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_shard, args=(r, cfg, plans, str(tmp_path / "store"), results))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    got = dict((r, rest) for r, *rest in (results.get(timeout=600) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (outs0, scores0, counters), (outs1, scores1, _) = got[0], got[1]
    assert outs0 == expected  # TP=1's tokens, plan by plan
    assert outs1 == expected  # every rank samples the same tokens
    assert scores0 is not None and (scores0 == scores1).all()  # the same bits: the same pages
    assert abs(scores0).sum() > 0
    # the plans ran on the self-planning graphs and started the next one early; the
    # asynchronous runs also continued such starts (these short staggered rounds drop theirs,
    # at TP=1 too: new requests arrive between them)
    if temperature:  # sampled runs and rounds: the shards agreed on their q stores
        assert counters["async" if mode == "aspire" else "verify"] > 0, counters
    elif mode == "aspire":
        assert counters["async"] > 0 and counters["runs_continued"] > 0, counters
    else:
        assert counters["chain"] > 0 and counters["rounds_started"] > 0, counters
