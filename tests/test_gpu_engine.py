"""The engine on a CUDA GPU with the Triton kernels (skipped without a GPU).

fp32: every mode's greedy output equals `ar` exactly. bf16: at least 5 of the 6 requests equal
`ar` in every mode (ties in bf16 logits can flip a greedy choice, docs/benchmarks.md §3.5; the
rates are printed: 6 of 6 in every mode on the H200 so far).
The CUDA graphs (the default: whole-step graphs for decode steps, piecewise ones otherwise) give
the same fp32 tokens as the eager forward.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import random_prompts, run_staggered, scripts_imported

from aspire_ray import SamplingParams
from aspire_ray.config import SPEC_MODES
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config
from aspire_ray.worker.graph_clock import CLOCK

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SMOLLM2_SHAPES = dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)


def _run(mode, dtype, temperature=0.0, max_tokens=32, num_pages=4096, lengths=(1, 300, 1200),
         requests=6, max_num_batched_tokens=2048, **kw):  # fmt: skip
    # contexts up to 1200 tokens: with k_min=8 pages draft rows are really sparse, and rows
    # over 32 pages take the split-KV path
    cfg = build_engine_config("dummy", load_format="dummy", hf_overrides=SMOLLM2_SHAPES,
                              device="cuda", dtype=dtype, spec_mode=mode, num_pages=num_pages,
                              max_num_batched_tokens=max_num_batched_tokens, k_min=8,
                              recent_pages=2, calibrate="off", **kw)  # fmt: skip
    engine = LLMEngine(cfg)
    worker = engine.executor.worker
    # the asynchronous graphs captured at start-up (sampled variants too: sampled_graphs_at_start)
    _run.start_keys = set(worker.async_graphs.graphs) if worker.async_graphs else None
    assert worker.backend.name == "triton"
    assert (worker.graphs is not None) == cfg.cuda_graphs
    prompts = random_prompts(requests, list(lengths), vocab=49152, seed=5)
    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature,
                             top_p=0.9 if temperature else 1.0, seed=i, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    out = run_staggered(engine, prompts, params, arrive_every=2)
    _run.last_worker, _run.last_engine = worker, engine
    return out


@pytest.mark.parametrize("mode", ["ar", "magicdec", "aspire"])
def test_cuda_graphs_equal_eager(mode):
    # piecewise graphs for steps with prefill rows, whole-step graphs for decode steps
    graphed = _run(mode, "float32")
    worker = _run.last_worker
    # ar's decode chains replay the chain-step graphs, aspire's asynchronous runs theirs
    whole_steps = worker.step_graphs.steps + (worker.draft_graphs.steps if mode == "ar" else 0)
    whole_steps += worker.async_graphs.steps if mode == "aspire" else 0
    assert graphed == _run(mode, "float32", cuda_graphs=False)
    assert whole_steps > 20, "decode steps did not replay the whole-step graphs"


@pytest.mark.parametrize("mode", ["aspire", "aspire_fixed"])
def test_drafts_without_the_refresh_layer_on_gpu(mode):
    # SpecConfig.draft_refresh False (bench variant norefresh): pages re-chosen at
    # verifications only; aspire's asynchronous graphs then rescore verify rows alone, the
    # rounds' graphs as specattn's. fp32: the graphs' tokens are eager's and ar's
    graphed = _run(mode, "float32", draft_refresh=False)
    worker = _run.last_worker
    steps = worker.async_graphs.steps if mode == "aspire" else worker.draft_graphs.steps
    assert not worker.cfg.spec.refresh_while_drafting and steps > 20
    # aspire's steps of draft rows only replayed their lean graphs (EngineConfig.async_lean_steps)
    assert mode != "aspire" or 0 < worker.async_graphs.lean_steps < steps
    assert graphed == _run(mode, "float32", draft_refresh=False, cuda_graphs=False)
    assert graphed == _run("ar", "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_mode_vs_ar_on_gpu(dtype):
    expected = _run("ar", dtype)
    rates = {}
    for mode in SPEC_MODES[1:]:
        got = _run(mode, dtype)
        same = sum(a == b for a, b in zip(got.values(), expected.values(), strict=True))
        rates[mode] = same / len(expected)
        if dtype == "float32":
            assert got == expected, mode
    print(f"\n{dtype} identical-request rate vs ar: {rates}")
    assert all(rate >= 5 / 6 for rate in rates.values()), rates


@pytest.mark.parametrize("mode", ["ar", "magicdec", "specattn", "aspire_fixed"])
def test_draft_graphs_on_gpu(mode):
    # chain steps as self-planning graphs (the default) vs planned on the host: same output
    # (ar: decode chains; also the same as one plan per decode step)
    graphed = _run(mode, "float32")
    steps = _run.last_worker.draft_graphs.steps
    assert graphed == _run(mode, "float32", draft_graphs=False) == _run("ar", "float32",
                                                                        ar_chain=1)
    assert steps > 20, "draft steps did not replay the draft-step graphs"


@pytest.mark.parametrize("mode", ["ar", "magicdec", "aspire_fixed"])
def test_sampled_draft_graphs_on_gpu(mode):
    # seeded sampling (top-p 0.9): the graphs draw each draft as the host-planned steps do
    # (ar: each token as one plan per decode step draws it) and verify each round in its plan
    # as they do (sampled_rows.py); no round started early (a dropped one's page scores may
    # change later drafts, and with them sampled tokens)
    graphed = _run(mode, "float32", temperature=0.8, rounds_overlap=False)
    steps = _run.last_worker.draft_graphs.steps
    if mode != "ar":
        assert _run.last_worker.draft_graphs.verify.steps > 5, "no sampled round on a graph"
    assert graphed == _run(mode, "float32", temperature=0.8, draft_graphs=False,
                           rounds_overlap=False)  # fmt: skip
    if mode == "ar":
        assert graphed == _run(mode, "float32", temperature=0.8, ar_chain=1)
    assert steps > 20, "sampled draft steps did not replay the draft-step graphs"


@pytest.mark.parametrize("mode", ["aspire", "aspire_fsm"])
def test_async_graphs_on_gpu(mode):
    # asynchronous runs on the self-planning graphs vs planned on the host vs one plan per
    # step: the same output as ar (fp32)
    graphed = _run(mode, "float32")
    steps = _run.last_worker.async_graphs.steps
    assert graphed == _run(mode, "float32", draft_graphs=False) == _run(mode, "float32",
                                                                        async_steps=1)
    assert graphed == _run("ar", "float32")
    assert steps > 20, "steps did not replay the asynchronous graphs"


@pytest.mark.parametrize("mode", ["aspire", "aspire_fsm"])
def test_sampled_async_graphs_on_gpu(mode):
    # seeded sampling (top-p 0.9) in asynchronous runs: the graphs (q kept on the device, the
    # filter, draws and acceptance in their Triton kernels) draw and verify as the
    # host-planned steps of the same runs do. Without runs started early: one started and
    # dropped leaves its page scores behind, later drafts may differ, and with them sampled
    # tokens (their distribution does not: tests/test_sampling.py)
    graphed = _run(mode, "float32", temperature=0.8, async_overlap_steps=0)
    graphs = _run.last_worker.async_graphs
    assert set(graphs.graphs) == _run.start_keys, "a sampled run captured a graph"
    assert graphed == _run(mode, "float32", temperature=0.8, draft_graphs=False,
                           async_overlap_steps=0)  # fmt: skip
    assert graphs.steps > 20, "sampled steps did not replay the asynchronous graphs"
    assert any(v is not None for _, _, v, _ in graphs.graphs), "no sampled graph variant ran"
    # started early, continued on the device: every request still gets all its tokens
    # (an H100: aspire_fsm's continued 2 of its runs, its draft lengths change run to run)
    overlapped = _run(mode, "float32", temperature=0.8, max_tokens=96)
    assert _run.last_worker.async_graphs.runs_continued >= 2
    assert all(len(tokens) == 96 for tokens in overlapped.values())


@pytest.mark.parametrize("mode", ["magicdec", "aspire_fixed", "aspire", "aspire_fsm"])
def test_coupled_sampling_gives_ars_text_on_gpu(mode):
    # SpecConfig.coupled_sampling: drafts and verifications race on the target's noise, so
    # sampled text (top-p 0.9, seeded) is ar's in fp32 with every graph family on, runs and
    # rounds started early included (their dropped drafts change no committed token)
    ar = _run("ar", "float32", temperature=0.8)
    coupled = _run(mode, "float32", temperature=0.8, coupled_sampling=True)
    worker = _run.last_worker
    graphs = worker.async_graphs if mode in ("aspire", "aspire_fsm") else worker.draft_graphs
    assert coupled == ar
    assert graphs.steps > 20, "sampled steps did not replay the graphs"


@pytest.mark.parametrize("mode", ["aspire", "aspire_fsm"])
def test_runs_started_early_on_gpu(mode):
    # zero-bubble runs: the next run's first steps replay before the current run's tokens
    # reach the host; the same fp32 output with them as without them and as ar
    overlapped = _run(mode, "float32", max_tokens=96)
    graphs = _run.last_worker.async_graphs
    assert overlapped == _run(mode, "float32", max_tokens=96, async_overlap_steps=0)
    assert overlapped == _run("ar", "float32", max_tokens=96)
    assert graphs.runs_continued >= 3, (graphs.runs_started, graphs.runs_continued)
    if mode == "aspire":  # verify slots: runs end on the slot cycle, each promising the next
        slotted = _run(mode, "float32", max_tokens=96, verify_quantum=4)
        graphs = _run.last_worker.async_graphs
        assert slotted == overlapped
        assert graphs.runs_continued >= 3, (graphs.runs_started, graphs.runs_continued)


@pytest.mark.parametrize("mode", ["magicdec", "aspire_fixed"])
def test_rounds_started_early_on_gpu(mode):
    # greedy rounds: the next plan's first round replays before this plan's tokens reach the
    # host; the same fp32 output with it as without it and as ar
    overlapped = _run(mode, "float32", max_tokens=96)
    graphs = _run.last_worker.draft_graphs
    assert overlapped == _run(mode, "float32", max_tokens=96, rounds_overlap=False)
    assert overlapped == _run("ar", "float32", max_tokens=96)
    assert graphs.rounds_continued >= 3, (graphs.rounds_started, graphs.rounds_continued)


def test_decode_chains_started_early_on_gpu():
    # ar's greedy decode chains: the next chain replays before this chain's tokens reach the
    # host; the same fp32 output with it as without it
    overlapped = _run("ar", "float32", max_tokens=96, ar_overlap=True)
    graphs = _run.last_worker.draft_graphs
    assert overlapped == _run("ar", "float32", max_tokens=96, ar_overlap=False)
    assert graphs.chains_continued >= 3, (graphs.chains_started, graphs.chains_continued)


# the modules of the greedy graph runs: a plan's one wait is an event sync behind its own steps
GRAPH_RUN_MODULES = ("async_runs.py", "async_graphs.py", "decode_chains.py", "round_runs.py",
                     "draft_graphs.py", "verify_graphs.py", "device_result.py", "page_table.py",
                     "draft_pages.py", "step_rows.py", "host.py")  # fmt: skip


@pytest.mark.parametrize("mode", ["ar", "aspire_fixed", "aspire"])
def test_greedy_graph_runs_never_sync_the_host(mode):
    # a synchronizing call in a graph run's path (a copy from pageable memory such as
    # torch.tensor(..., device=cuda), .item(), a blocking copy) also waits for the steps
    # started early for the next plan: the GPU then idles while the host plans. The debug mode
    # warns at each one, from the Python line that made it (prefills' eager steps sync in
    # worker.py; they are not graph runs)
    with scripts_imported("bench_decode") as (bd,), warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _run(mode, "float32", max_tokens=96)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        sites = bd.sync_sites(log)
    bad = {site: n for site, n in sites.items()
           if site.split(":")[0].endswith(GRAPH_RUN_MODULES)}  # fmt: skip
    assert not bad, bad
    counters = _run.last_worker.graph_counters()
    continued = {"ar": "chains_continued", "aspire_fixed": "rounds_continued",
                 "aspire": "runs_continued"}[mode]  # fmt: skip
    assert counters[continued] >= 3, counters


@pytest.mark.parametrize("mode", ["ar", "aspire_fixed", "aspire"])
def test_spin_wait_gives_the_same_tokens_on_gpu(mode):
    # EngineConfig.device_wait="spin": the host polls a pinned flag copied after the tokens
    # instead of syncing on an event; the same fp32 output, the runs still continued early
    spun = _run(mode, "float32", max_tokens=96, device_wait="spin")
    counters = _run.last_worker.graph_counters()
    assert spun == _run(mode, "float32", max_tokens=96)
    continued = {"ar": "chains_continued", "aspire_fixed": "rounds_continued",
                 "aspire": "runs_continued"}[mode]  # fmt: skip
    assert counters[continued] >= 3, counters


@pytest.mark.parametrize("mode,kw", [("ar", {}), ("aspire_fixed", {}), ("aspire", {}),
                                     ("ar", {"deterministic": True})],
                         ids=["ar", "aspire_fixed", "aspire", "ar-det"])  # fmt: skip
def test_programmatic_dependent_launch_gives_the_same_tokens_on_gpu(mode, kw, monkeypatch):
    # kernels/pdl.py, on by default (ASPIRE_PDL=0: off): the decoder layer's Triton kernels
    # launched with PDL, captured so in the graphs, each waiting for its predecessor on the
    # device; the arithmetic is the same (only griddepcontrol and L2 prefetches added), so bf16
    # tokens are bit for bit. ar-det: the deterministic mode's projections through
    # kernels/linear.py
    from aspire_ray.kernels import pdl

    monkeypatch.setenv(pdl.ENV, "0")
    plain = _run(mode, "bfloat16", max_tokens=64, **kw)
    monkeypatch.delenv(pdl.ENV)
    assert pdl.enabled(torch.device("cuda", torch.cuda.current_device())) == \
        (torch.cuda.get_device_capability()[0] >= 9)  # fmt: skip
    launched = _run(mode, "bfloat16", max_tokens=64, **kw)
    worker = _run.last_worker
    graphed = sum(g.steps for g in (worker.step_graphs, worker.draft_graphs, worker.async_graphs)
                  if g is not None)  # fmt: skip
    assert launched == plain
    assert graphed > 20, "no decode step replayed a graph"


@pytest.mark.parametrize("mode", ["ar", "aspire_fixed", "aspire"])
def test_the_merge_inside_the_attention_launch_gives_the_same_tokens_on_gpu(mode):
    # AttentionConfig.fused_merge: each query tile's last split program merges it, whichever
    # finishes last, in the graphs too. fp32: the merge groups its splits otherwise than the
    # merge launch (2 a load, not 16), ~1e-7 apart, so the tokens stay the same
    plain = _run(mode, "float32", max_tokens=64)
    fused = _run(mode, "float32", max_tokens=64, attention_options={"fused_merge": True})
    worker = _run.last_worker
    graphed = sum(g.steps for g in (worker.step_graphs, worker.draft_graphs, worker.async_graphs)
                  if g is not None)  # fmt: skip
    assert worker.backend.config.fused_merge
    assert fused == plain
    assert graphed > 20, "no decode step replayed a graph"


def test_graph_clock_times_replays_on_gpu():
    # every replay bracketed on the GPU's clock (the engine's warm-up included, phase
    # "other"): busy and idle add up to the span, the asynchronous runs' phases are named
    CLOCK.start()
    try:
        _run("aspire", "float32", max_tokens=96)
    finally:
        raw = _run.last_worker.graph_clock(False)
    with scripts_imported("floor_report") as (fr,):
        clock = fr.clock_summary(raw)
    assert clock["replays"] > 0 and clock["dropped"] == 0 and clock["busy_ms"] > 0
    assert clock["busy_ms"] + clock["gap_ms"] == pytest.approx(clock["span_ms"], rel=1e-6)
    phases = clock["by_phase"]
    assert {"async:run", "async:early", "async:continue"} <= set(phases), phases
    assert phases["async:continue"]["replays"] >= 3 * 12  # runs of 16 steps, 4 started early
    assert len(raw["launch_ms"]) == clock["replays"] and min(raw["launch_ms"]) > 0
    assert phases["async:continue"]["launch_host_max_ms"] >= 0
    host = clock["host"]  # the host's wait and launches, placed on the GPU's clock
    assert host["async:woke"]["count"] >= 3 and host["async:launch"]["count"] >= 3, host
    assert host["async:woke"]["wake_latency_ms_median"] > -1.0  # not before its tokens were
    # each replay filed under its graph's step kind: the runs' steps, the warm-up's others
    kinds = clock["by_kind"]  # an asynchronous step with verify rows in it, or draft rows only
    runs = kinds["async"]["replays"] + kinds["async_verify"]["replays"]
    assert runs >= phases["async:continue"]["replays"], kinds
    assert kinds["async"]["replays"] > 0 and kinds["async_verify"]["replays"] > 0, kinds
    assert sum(k["replays"] for k in kinds.values()) == clock["replays"]


@pytest.mark.parametrize("mode", ["ar", "magicdec", "aspire_fixed", "aspire"])
def test_fused_row_planning_is_the_tensor_ops_bit_for_bit(mode):
    # kernels/row_plan.py plans the graphs' rows (integers only: tokens, slots, page lists) and
    # accepts, so the steps attend to the same pages in the same order: bf16 output is equal
    fused = _run(mode, "bfloat16", max_tokens=64)
    worker = _run.last_worker
    steps = (worker.async_graphs or worker.draft_graphs).steps
    assert fused == _run(mode, "bfloat16", max_tokens=64, fused_row_planning=False)
    assert steps > 20, "no step replayed the self-planning graphs"


@pytest.mark.parametrize("graphs,pages", [(True, 4096), (False, 4096), (True, 100)],
                         ids=["graphs", "eager", "preempting"])
def test_deterministic_bf16_every_mode_is_ar(graphs, pages):
    # issue 18: with EngineConfig.deterministic every row's logits are the same bits whatever
    # its step, so bf16 greedy output of every speculative mode is `ar`'s, token for token
    # (without it, 5 of 6 requests at best: test_every_mode_vs_ar_on_gpu); requests arrive
    # mid-run (run_staggered), and with 100 pages and no admission headroom some are preempted
    # and recomputed (4 times in `ar`, checked on the CPU)
    kw = dict(max_tokens=64, deterministic=True, cuda_graphs=graphs, num_pages=pages,
              admission_headroom_tokens=0 if pages < 4096 else None)
    expected = _run("ar", "bfloat16", **kw)
    for mode in SPEC_MODES[1:]:
        assert _run(mode, "bfloat16", **kw) == expected, mode
        if pages < 4096:
            assert _run.last_engine.stats()["preemptions"] > 0, mode


def test_deterministic_bf16_long_rows_and_prompts_in_pieces():
    # issue 18, what the test above missed (64 x 2,000-token rows parted from `ar` in 13 of 64
    # requests, some at their first token, scripts/diag_det.py): 16 rows of 2-3k tokens, each
    # split in 64-page KV chunks, verify rows crossing into pages their first queries do not
    # see, prompts prefilled in pieces of another size in the reference; random weights make
    # near ties common, so a differing bit soon flips a token
    kw = dict(max_tokens=96, deterministic=True, lengths=(2000, 2900), requests=16)
    expected = _run("ar", "bfloat16", max_num_batched_tokens=8192, **kw)
    assert _run("ar", "bfloat16", max_num_batched_tokens=1024, **kw) == expected
    for mode in SPEC_MODES[1:]:
        assert _run(mode, "bfloat16", **kw) == expected, mode


def test_older_collections_fall_in_the_waits_on_gpu(monkeypatch):
    # EngineConfig.gc_at_waits (worker/gc_waits.py): every collection of generation 1 or 2
    # in an engine step runs inside gc_waits.collect, where queued GPU work hides it, none
    # between two plans (where the 10-20 ms ones of §8.36 stalled the GPU)
    import gc

    from aspire_ray.worker import gc_waits

    where = {"step": 0, "wait": 0}
    outside, inside = [], []

    def entered(key, fn):
        def run(*args, **kw):
            where[key] += 1
            try:
                return fn(*args, **kw)
            finally:
                where[key] -= 1

        return run

    def watch(phase, info):
        if phase == "start" and info["generation"] >= 1 and where["step"]:
            (inside if where["wait"] else outside).append(info["generation"])

    monkeypatch.setattr(gc_waits, "collect", entered("wait", gc_waits.collect))
    monkeypatch.setattr(LLMEngine, "step", entered("step", LLMEngine.step))
    gc.callbacks.append(watch)
    try:
        _run("aspire", "float32", max_tokens=96, requests=12)
    finally:
        gc.callbacks.remove(watch)
    assert inside and not outside, (inside, outside)


def test_shutdown_gives_the_gpu_memory_back():
    # heap.return_device_memory: the next engine, or a Serve replica, on this GPU sizes its KV
    # pool by what the driver reports free; what the caching allocator kept for this process
    # (the KV pool, the graphs' pools, held in cycles) must go back at shutdown
    _run.last_worker = _run.last_engine = None  # earlier tests' engines: not this test's
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    # no num_pages: the KV pool takes gpu_memory_utilization of the free memory
    cfg = build_engine_config("dummy", load_format="dummy", hf_overrides=SMOLLM2_SHAPES,
                              device="cuda", dtype="bfloat16", spec_mode="aspire",
                              calibrate="off")  # fmt: skip
    engine = LLMEngine(cfg)
    assert torch.cuda.mem_get_info()[0] < free_before / 2  # the pool took most of it
    run_staggered(engine, random_prompts(4, [300, 1200], vocab=49152, seed=2),
                  [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * 4)
    engine.shutdown()
    assert torch.cuda.mem_get_info()[0] >= free_before - (256 << 20)


@pytest.mark.parametrize("mode", ["ar", "aspire"])
def test_triton_projections_run_in_the_graphs_on_gpu(mode, monkeypatch):
    # EngineConfig.triton_projections: the o and down projections of decode-sized bf16 steps
    # through kernels/linear.py, captured in the graphs; its products are cuBLAS's to bf16
    # rounding (not bit for bit, so the tokens are not compared with cuBLAS's run)
    from aspire_ray.kernels import linear

    shapes = []
    real = linear.triton_linear
    monkeypatch.setattr(linear, "triton_linear",
                        lambda x, w, *a: shapes.append(tuple(w.shape)) or real(x, w, *a))
    out = _run(mode, "bfloat16", max_tokens=48, triton_projections=("o", "down"))
    worker = _run.last_worker
    graphed = sum(g.steps for g in (worker.step_graphs, worker.draft_graphs, worker.async_graphs)
                  if g is not None)  # fmt: skip
    assert {(576, 576), (576, 1536)} <= set(shapes)  # o [hidden, heads x dim], down [hidden, I]
    assert graphed > 20 and all(len(tokens) == 48 for tokens in out.values())
    # the two paths' products on one decode-sized input
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((576, 576), (576, 1536)):
        x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k**0.5
        got = real(x, w, None, linear.invariant_config(n, k))
        torch.testing.assert_close(got, torch.nn.functional.linear(x, w), atol=2e-2, rtol=2e-2)
