"""Decode throughput of every speculation mode, side by side in one run.

Committed tokens per second of decode wall time: prefill is excluded (the clock starts once
every request of the batch has finished its prompt) and a warm-up batch runs first. Per mode:
tokens/s, speedup over `ar`, mean accepted length, acceptance by draft position, gamma
distribution, and the step-time breakdown (draft / verify / mixed steps, refresh, sampling,
scheduling).

    python scripts/bench_decode.py --device cuda --dtype bfloat16 --contexts 2048,4096,8000 \
        --batch 64 --max-tokens 256 --out docs/bench_decode_h200.json

Without the model's weights, ``--dummy-shapes smollm2`` runs SmolLM2-135M's architecture with
random weights on random-token prompts: step costs are the real ones, acceptance rates are not.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import random
import re
import statistics
import sys
import time
import warnings

from bench_tp import SHAPES
from floor_report import clock_summary
from traces import TraceRecorder, Traces, engine_meta
from workloads import (
    available_domains,
    heterogeneous_requests,
    long_context_prompts,
    short_prompts,
)

from aspire_ray import LLM, SamplingParams
from aspire_ray.config import SpecConfig

MODES = "ar,magicdec,specattn,aspire_fixed,aspire_fsm,aspire"
MAX_BATCH = 1024  # cap of --batch max
DUMMY_SHAPES = {
    "smollm2": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True, rms_norm_eps=1e-5),
    # DESIGN.md §5: the real 32k model's shapes (untied head, q/k/v bias from the qwen2 family)
    "qwen2.5-coder-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                               num_hidden_layers=24, num_attention_heads=14,
                               num_key_value_heads=2, head_dim=64, vocab_size=151936,
                               max_position_embeddings=32768, rope_theta=1000000.0,
                               tie_word_embeddings=False, rms_norm_eps=1e-6),
    **SHAPES,  # the paper shapes (qwen3-8b, qwen3-1.7b, llama-8b) and tiny-qwen3 for CPU runs
}


VARIANTS = {  # MODE/VARIANT: MODE with these engine options, to compare in one run
    "": {},
    "nochain": {"draft_chains": False, "ar_chain": 1},  # one plan per draft (ar: decode) step
    "round": {"chain_verify": True},  # chains that carry their round's verification
    "noround": {"chain_verify": False},  # the verification as a plan of its own
    "hostplan": {"draft_graphs": False},  # chain steps planned on the host, not in their graph
    "hostverify": {"verify_graphs": False},  # round verification planned on the host
    # nothing of the next plan started before this one's tokens reach the host
    "serial": {"rounds_overlap": False, "async_overlap_steps": 0, "ar_overlap": False},
    # ar's next decode chain started before this one's tokens reach the host (the default)
    "aroverlap": {"ar_overlap": True},
    "noaroverlap": {"ar_overlap": False},
    # a plan's attention launches one after another, not side by side on two streams
    "seqattn": {"attention_options": {"concurrent_launches": False}},
    # the self-planning graphs' rows planned by tensor ops, not one launch (kernels/row_plan.py)
    "torchplan": {"fused_row_planning": False},
    # the attention's register caps (more programs resident on an SM; docs/benchmarks.md §8.23)
    "regs": {"attention_options": {"max_registers": 96, "wide_max_registers": 168}},
    "noregs": {"attention_options": {"wide_max_registers": None}},
    # the older split-KV chunk (total pages / (waves x SMs)), not the wave-fitted one
    "oldsplit": {"attention_options": {"resident_programs": None}},
    # 32-row query tiles with the compiler's registers (before session 28)
    "nomid": {"attention_options": {"mid_max_registers": None}},
    # verify rows in 128-row query tiles: 18 queries of Qwen2.5's 7-head groups read their KV
    # once (64 rows: 9), so draft lengths up to 17 verify in one KV read (kernels/attention_config
    # query_tile_tokens; the cost model and the verify slots follow it)
    "m128": {"attention_options": {"block_m_max": 128}},
    # a mixed step's draft rows in a launch of their own beside the verify rows' (two launches)
    "twolaunch": {"attention_options": {"mixed_one_launch": False}},
    # split rows merged by their last chunk's program in the attention launch, no merge launch
    # (AttentionConfig.fused_merge, on by default since session 40), or in a launch of their own
    "fmerge": {"attention_options": {"fused_merge": True}},
    "sepmerge": {"attention_options": {"fused_merge": False}},
    # the refresh layer while drafting off (pages re-chosen at verifications only, as specattn)
    # or on, against the mode's row (SpecConfig.draft_refresh): "aspire/norefresh"
    "norefresh": {"draft_refresh": False},
    "refresh": {"draft_refresh": True},
    # every row's logits independent of its step (EngineConfig.deterministic, issue 18)
    "det": {"deterministic": True},
    # tp > 1: the shards replay CUDA graphs with the collectives inside (issue 17)
    "tpgraphs": {"tp_cuda_graphs": True},
    # Python's heap not frozen once the engine is built: garbage collections walk it
    # (EngineConfig.gc_freeze, engine/heap.py)
    "nogcfreeze": {"gc_freeze": False},
    # garbage collections wherever they come due, not in the waits for the device
    # (EngineConfig.gc_at_waits, worker/gc_waits.py)
    "nogcwait": {"gc_at_waits": False},
    # the host polls a pinned flag for a graph run's tokens, not a CUDA event sync
    # (EngineConfig.device_wait; docs/benchmarks.md §8.31, §8.34: no faster than the event)
    "spinwait": {"device_wait": "spin"},
    # cuBLAS qkv / gate_up and RoPE / SiLU as kernels of their own, not fused (model/decoder.py)
    "nofused": {"fused_epilogues": False},
    # each MLP in one launch, its down projection's sum in the next norm (EngineConfig.fused_mlp)
    "fusedmlp": {"fused_mlp": True},
    # the o / down / both projections through kernels/linear.py, not cuBLAS
    # (EngineConfig.triton_projections: every kernel of a layer in the PDL chain)
    "tlo": {"triton_projections": ("o",)},
    "tldown": {"triton_projections": ("down",)},
    "tlod": {"triton_projections": ("o", "down")},
    # DESIGN.md §1.5's acceptance estimate, the EMA of a / min(a + 1, d) (docs/speculation.md)
    "perround": {"alpha_estimator": "per_round"},
    # aspire's draft lengths priced as DESIGN.md §1.5's homogeneous batch (SpecConfig.gamma_pricing)
    "homogeneous": {"gamma_pricing": "homogeneous"},
    # sampled requests' draft lengths moved to the verify slots too (SpecConfig.slot_sampled)
    "slotsampled": {"slot_sampled": True},
    # sampled drafts and verifications on one noise (SpecConfig.coupled_sampling)
    "coupled": {"coupled_sampling": True},
    # every step of an asynchronous run on the full graph, draft-only steps too
    # (EngineConfig.async_lean_steps: their lean graph launches one query tile's attention,
    # and skips the rescoring without refresh)
    "nolean": {"async_lean_steps": False},
    # token buckets of the graphs 1 / 2 / 4 a doubling from 128 tokens (4, the default: the
    # verify and mixed steps' dense layers over fewer padding tokens; 1: powers of two)
    # (EngineConfig.graph_buckets_per_octave)
    "bk1": {"graph_buckets_per_octave": 1},
    "bk2": {"graph_buckets_per_octave": 2},
    "bk4": {"graph_buckets_per_octave": 4},
    # sampled graph variants captured at their first use, not at start-up
    # (EngineConfig.sampled_graphs_at_start)
    "lazysampled": {"sampled_graphs_at_start": False},
}


# bench variants PREFIX + N setting one AttentionConfig field of the Triton attention's launch
# (a decode step's attention is ~87% of SmolLM2's `ar` step and ~1.11x its KV bytes' floor:
# docs/benchmarks.md §8.55), e.g. "ar/ns4", "ar/bn64+nw8"
ATTENTION_KNOBS = {"bn": "block_n", "nw": "num_warps", "ns": "num_stages",
                   "rs": "resident_programs", "reg": "max_registers"}


ENV_VARIANTS = {  # MODE/VARIANT: MODE's engine built and run under these environment variables
    # (switches read at each kernel launch, not engine options; a mode without the variant runs
    # with them unset, so "ar,ar/nopdl" compares the two in one process)
    # the decoder layer's Triton kernels without / with programmatic dependent launch
    # (kernels/pdl.py; on by default where the GPU allows)
    "nopdl": {"ASPIRE_PDL": "0"},
    "pdl": {"ASPIRE_PDL": "1"},
}


# before each mode's timed runs, on the same engine: its kernels compiled, its graphs captured,
# and the draft policy's first verifications seen (a new request's prior, DraftPolicy.prior_alpha)
WARMUP_REQUESTS, WARMUP_TOKENS = 4, 8


def mode_options(mode: str) -> tuple[str, dict]:
    """A benchmark mode -> (spec mode, LLM options): "MODE/VARIANT", the variant one of
    VARIANTS (or of ENV_VARIANTS, no LLM option: ``mode_env``), gN (gamma = N), rN (N rounds
    per plan), aN (``ar``: N decode steps per plan), sN (``aspire``: N steps per asynchronous
    run), oN (``aspire``: N steps of the next run started early, ``async_overlap_steps``), dN
    (d_max = N), iN (``aspire``: gamma_init = N, the drafts before a request's first
    verification), fN (``aspire_fsm``: every draft length N, fsm_min = fsm_max = N), qN
    (``aspire``: verify_quantum = N, verifications on every N-th decode step), eNN
    (``aspire``: alpha_ema = 0.NN), rpN / mcN (the attention's split-KV fit: a program's
    fixed cost ``ramp_pages`` = N, the shortest chunk ``min_chunk_pages`` = N), bnN / nwN /
    nsN / rsN / regN (the attention launch's ``ATTENTION_KNOBS``) or several joined by "+",
    e.g. "aspire_fixed/round+g8", "aspire/sepmerge+rp32", "ar/ns4+nw8"."""
    spec_mode, _, variant = mode.partition("/")
    options = {}
    for part in variant.split("+") if variant else [""]:
        if re.fullmatch(r"g\d+", part):
            options["gamma"] = int(part[1:])
        elif re.fullmatch(r"r\d+", part):  # rounds per plan
            options["rounds_per_plan"] = int(part[1:])
        elif re.fullmatch(r"a\d+", part):  # ar: decode steps per plan
            options["ar_chain"] = int(part[1:])
        elif re.fullmatch(r"s\d+", part):  # aspire: steps per asynchronous run
            options["async_steps"] = int(part[1:])
        elif re.fullmatch(r"o\d+", part):  # aspire: next-run steps started early
            options["async_overlap_steps"] = int(part[1:])
        elif re.fullmatch(r"d\d+", part):  # the most drafts a request may hold
            options["d_max"] = int(part[1:])
        elif re.fullmatch(r"i\d+", part):  # aspire: drafts before the first verification
            options["gamma_init"] = int(part[1:])
        elif re.fullmatch(r"q\d+", part):  # aspire: verifications on every N-th step
            options["verify_quantum"] = int(part[1:])
        elif re.fullmatch(r"e\d\d", part):  # aspire: alpha_ema = 0.NN
            options["alpha_ema"] = int(part[1:]) / 100
        elif re.fullmatch(r"f\d+", part):  # aspire_fsm: gamma held at N (fsm_min = fsm_max)
            options["fsm_min"] = options["fsm_max"] = int(part[1:])
        elif re.fullmatch(r"rp\d+", part):  # the split-KV fit's fixed cost of a program, pages
            _attention_option(options, ramp_pages=int(part[2:]))
        elif re.fullmatch(r"mc\d+", part):  # the split-KV's shortest chunk, pages
            _attention_option(options, min_chunk_pages=int(part[2:]))
        elif m := re.fullmatch(r"(bn|nw|ns|rs|reg)(\d+)", part):  # the attention's launch
            _attention_option(options, **{ATTENTION_KNOBS[m[1]]: int(m[2])})
        elif part in VARIANTS:
            for key, value in VARIANTS[part].items():
                if key == "attention_options":  # joined: "sepmerge+rp32" keeps both
                    _attention_option(options, **value)
                else:
                    options[key] = value
        elif part not in ENV_VARIANTS:  # those set the environment: ``mode_env``
            known = [v for v in (*VARIANTS, *ENV_VARIANTS) if v]
            raise SystemExit(f"unknown mode variant {part!r} in {mode!r} (known: gN, rN, aN, "
                             f"sN, oN, dN, iN, eNN, fN, qN, rpN, mcN, bnN, nwN, nsN, rsN, regN, "
                             f"{', '.join(known)})")
    return spec_mode, options


def _attention_option(options: dict, **settings) -> None:
    """AttentionConfig settings joined into a mode's ``attention_options``."""
    options["attention_options"] = {**options.get("attention_options", {}), **settings}


def mode_env(mode: str) -> dict[str, str | None]:
    """A benchmark mode -> the environment its engine is built and run under: every
    ``ENV_VARIANTS`` variable, set as the variant says where the mode names it ("ar/nopdl",
    "magicdec/g8+nopdl"), else None (unset: the default)."""
    _, _, variant = mode.partition("/")
    parts = variant.split("+") if variant else []
    env: dict[str, str | None] = {k: None for values in ENV_VARIANTS.values() for k in values}
    for part in parts:
        env.update(ENV_VARIANTS.get(part, {}))
    return env


@contextlib.contextmanager
def mode_environment(mode: str):
    """Build and run a mode's engine inside this: its ``mode_env`` applied, the caller's
    environment back after. A CUDA graph keeps the launches of its capture, so each engine's
    graphs keep its mode's switches; at tp > 1 the shard actors, processes started once per
    Ray session, need not see them."""
    env = mode_env(mode)
    saved = {k: os.environ.get(k) for k in env}
    try:
        _set_env(env)
        yield
    finally:
        _set_env(saved)


def _set_env(env: dict[str, str | None]) -> None:
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def _progress(total: int, desc: str):
    if not sys.stderr.isatty():  # logs stay readable
        return None
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, leave=False, mininterval=2.0)
    except ImportError:
        return None


def _committed(engine, finished: dict) -> int:
    return sum(len(r.output_token_ids) for r in engine.requests.values()) + \
        sum(len(o.token_ids) for o in finished.values())  # fmt: skip


def window_state(engine, finished: dict) -> dict[str, int]:
    """The batch's tokens committed so far, its verifications (with drafts; RequestMetrics),
    the drafts they verified and accepted, and the drafts held unverified now: two of them
    (``window_delta``) say what a window's tokens came from, and what work it leaves
    uncommitted at its end (a run's drafts not yet verified)."""
    metrics = [r.metrics for r in engine.requests.values()] + \
        [o.metrics for o in finished.values()]  # fmt: skip
    return {"tokens": _committed(engine, finished),
            "verifications": sum(m.verifications for m in metrics),
            "drafts_verified": sum(sum(m.gamma_history) for m in metrics),
            "drafts_accepted": sum(m.accepted for m in metrics),
            "drafts_held": sum(len(r.drafts) for r in engine.requests.values())}


def window_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """A window's ``window_state`` counts (after less before), the drafts held at its ends."""
    out = {k: after[k] - before[k] for k in after if k != "drafts_held"}
    return {**out, "drafts_held_start": before["drafts_held"],
            "drafts_held_end": after["drafts_held"]}


def prefill_batch(engine, prompts: list[list[int]],
                  params: SamplingParams | list[SamplingParams],
                  desc: str) -> tuple[list[str], dict]:  # fmt: skip
    """Add the requests (one params for all, or one each) and run their prompts only, so that
    every one of them starts decoding in the same step; returns their ids and the outputs of
    any that already finished."""
    ids = [f"{desc}-{i}" for i in range(len(prompts))]
    each = params if isinstance(params, list) else [params] * len(prompts)
    for rid, p, sp in zip(ids, prompts, each, strict=True):
        engine.add_request(rid, p, sp)
    finished = {}
    engine.scheduler.pause_decoding = True
    while any(r.in_prefill or r.num_computed == 0 for r in engine.requests.values()):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    engine.scheduler.pause_decoding = False
    return ids, finished


def decode_run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
               desc: str, window: str = "steady", diagnose: bool = False,
               profile_steps: int = 0, profile_before: bool = False) -> dict:  # fmt: skip
    """Prefill everything, then time the decode phase.

    window "steady": the clock stops when the first request finishes, so every row of the
    batch decodes for the whole window (a serving engine refills its batch; a batch that
    drains runs its last steps for a few rows at nearly the cost of a full step, and
    speculative requests finish at different times while `ar` requests finish together).
    "drain": the clock stops when the last request finishes. Either way every request runs to
    the end (acceptance and greedy-match statistics cover whole outputs).
    diagnose: over the window, time every graph replay on the GPU and log synchronizing CUDA
    calls (``Diagnosis``; slows the host a little, so not for the figures themselves).
    profile_steps: after the window (before it with profile_before: every row of the batch
    still decoding, the steps the window times), this many engine steps under torch's
    profiler: the GPU
    kernels by time (``breakdown.kernels``, ``profile_kernels``), outside the clock.
    """
    engine = llm.engine
    each = params if isinstance(params, list) else [params] * len(prompts)
    started = time.perf_counter()  # the run's own wall time (prefill, window, the rest)
    ids, finished = prefill_batch(engine, prompts, each, desc)
    prefill_s = time.perf_counter() - started
    kernels = profile_kernels(engine, profile_steps, finished) \
        if profile_steps and profile_before else None  # fmt: skip
    before = {k: dict(v) if isinstance(v, dict) else v for k, v in engine.stats().items()}
    graphs_before, process_before = _graph_counters(engine), process_counters()
    state_before = window_state(engine, finished)
    diagnosis = Diagnosis(engine) if diagnose else None
    done_before = len(finished)
    bar = _progress(sum(p.max_tokens for p in each), desc)
    t0 = time.perf_counter()
    elapsed = None
    while engine.has_unfinished():
        if elapsed is not None and profile_steps and kernels is None:
            kernels = profile_kernels(engine, profile_steps, finished)
            continue
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if elapsed is None and window == "steady" and len(finished) > done_before:
            elapsed = time.perf_counter() - t0
            state_after, after = window_state(engine, finished), engine.stats()
            graphs_after, process_after = _graph_counters(engine), process_counters()
            diagnosed = diagnosis.stop() if diagnosis else None
        if bar is not None:
            bar.n = _committed(engine, finished)
            bar.refresh()
    if elapsed is None:
        elapsed = time.perf_counter() - t0
        state_after, after = window_state(engine, finished), engine.stats()
        graphs_after, process_after = _graph_counters(engine), process_counters()
        diagnosed = diagnosis.stop() if diagnosis else None
    if bar is not None:
        bar.close()
    outs = [finished[r] for r in ids]
    breakdown = _diff(after, before)
    # in the window: forwards replayed as whole-step graphs by family, and plans whose next
    # one started early on the device / was continued (Worker.graph_counters)
    breakdown["graphs"] = {k: v - graphs_before.get(k, 0) for k, v in graphs_after.items()}
    # the window's tokens, verifications and drafts (``window_state``): its tokens per
    # verification, and the drafts held unverified at its start and end
    breakdown["window"] = window_delta(state_before, state_after)
    # and what can stall the host or the GPU between launches: Python's garbage collections
    # and their seconds, the CUDA caching allocator's cudaMalloc / cudaFree calls and its
    # retries (a failed cudaMalloc frees the cache after syncing every stream)
    breakdown["process"] = {k: v - process_before.get(k, 0) for k, v in process_after.items()}
    if diagnosed is not None:
        breakdown.update(diagnosed)
    if kernels is not None:
        breakdown["kernels"] = kernels
    return {"outs": outs, "seconds": elapsed, "tokens": breakdown["window"]["tokens"],
            "breakdown": breakdown, "prefill_s": prefill_s,
            "wall_s": time.perf_counter() - started}


def profile_kernels(engine, steps: int, finished: dict, top: int = 60) -> dict:
    """``steps`` engine steps (or fewer: the batch's end) under torch's profiler -> the wall
    seconds, the GPU kernels' total and count (``launches``: kernels and copies), the ``top``
    kernels by GPU time (name, ms, calls) and the graph clock of the same steps
    (``gpu_clock``: their replays' GPU time, to set beside the kernels' sum: the difference is
    time inside the replays with no kernel running). Finished requests' outputs go to
    ``finished``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    done = 0
    cuda = torch.cuda.is_available()
    _worker_call(engine, "graph_clock", True)
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        while done < steps and engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            done += 1
        if cuda:
            torch.cuda.synchronize()
    clock = clock_summary(_worker_call(engine, "graph_clock", False))
    wall = time.perf_counter() - t0
    rows = [(e.key, e.self_device_time_total / 1e3, e.count) for e in prof.key_averages()
            if e.self_device_time_total > 0]  # fmt: skip
    rows.sort(key=lambda r: -r[1])
    total = sum(ms for _, ms, _ in rows)
    launches = sum(c for _, _, c in rows)
    report = {"steps": done, "wall_ms": wall * 1e3, "kernel_ms": total, "launches": launches,
              "top": [{"name": k[:100], "ms": ms, "calls": c} for k, ms, c in rows[:top]],
              "gpu_clock": {k: clock.get(k) for k in ("replays", "busy_ms", "gap_ms")}}
    print(f"profiled {done} steps: wall {wall * 1e3:.1f} ms, GPU kernels {total:.1f} ms, "
          f"{launches} launches; {clock.get('replays')} graph replays busy "
          f"{clock.get('busy_ms', 0):.1f} ms")
    for r in report["top"]:
        print(f"  {r['ms']:8.2f} ms {r['calls']:6d}x  {r['name']}")
    return report


class _GcClock:
    """Seconds spent in Python's garbage collections, by generation (a gc callback)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._start


_GC_CLOCK: _GcClock | None = None
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free",
                      "num_sync_all_streams")  # fmt: skip


def process_counters() -> dict[str, float]:
    """Counts so far: garbage collections and their seconds per generation; on a GPU the
    caching allocator's ``ALLOCATOR_COUNTERS`` (``torch.cuda.memory_stats``)."""
    global _GC_CLOCK
    if _GC_CLOCK is None:
        _GC_CLOCK = _GcClock()
    out = {}
    for g, (stats, secs) in enumerate(zip(gc.get_stats(), _GC_CLOCK.seconds, strict=True)):
        out[f"gc{g}_collections"], out[f"gc{g}_seconds"] = stats["collections"], secs
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        mem = torch.cuda.memory_stats()
        out.update({k: mem.get(k, 0) for k in ALLOCATOR_COUNTERS})
    return out


def _graph_counters(engine) -> dict[str, int]:
    """The in-process worker's ``graph_counters`` (tp 1), rank 0's at tp > 1."""
    return _worker_call(engine, "graph_counters", default={})


def _worker_call(engine, name: str, *args, default=None):
    """Worker method ``name`` on the in-process worker (tp 1), or rank 0's at tp > 1."""
    ex = engine.executor
    if hasattr(ex, "worker"):
        return getattr(ex.worker, name)(*args)
    return ex.call_ranks(name, *args)[0] if hasattr(ex, "call_ranks") else default


class Diagnosis:
    """Where a decode window's GPU time goes, measured without the profiler: the worker's
    graph clock (``graph_clock.py``: each graph replay timed on the GPU; the idle between
    replays by the phases either side, ``floor_report.clock_summary``; rank 0's) and, with
    the worker in this process, the CUDA calls that synchronized the host with the device
    (``torch.cuda.set_sync_debug_mode`` warnings, counted by the Python line that made them;
    the plan's intended wait, an event sync, is not one of them)."""

    def __init__(self, engine) -> None:
        import torch

        self.engine = engine
        self.cuda = torch.cuda.is_available() and engine.cfg.device.startswith("cuda")
        self._warnings = None
        if self.cuda and hasattr(engine.executor, "worker"):
            self._warnings = warnings.catch_warnings(record=True)
            self.log = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        _worker_call(engine, "graph_clock", True)

    def stop(self) -> dict:
        import torch

        out = {"gpu_clock": clock_summary(_worker_call(self.engine, "graph_clock", False))}
        if self._warnings is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._warnings.__exit__(None, None, None)
            out["syncs"] = sync_sites(self.log)
        return out


def sync_sites(log: list) -> dict[str, int]:
    """Synchronizing-call warnings (``warnings.WarningMessage``) -> count by "file:line",
    most first (other warnings are left out)."""
    sites: dict[str, int] = {}
    for w in log:
        if "synchroniz" in str(w.message):
            site = f"{os.path.relpath(w.filename)}:{w.lineno}"
            sites[site] = sites.get(site, 0) + 1
    return dict(sorted(sites.items(), key=lambda kv: -kv[1]))


def _diff(after: dict, before: dict) -> dict:
    out = {}
    for key in ("timings", "step_kinds", "step_seconds"):
        a, b = after[key], before[key]
        out[key] = {k: a[k] - b.get(k, 0) for k in a}
    out["steps"] = after["steps"] - before["steps"]
    out["cost_model"] = after["cost_model"]
    return out


def summarize(mode: str, run: dict, ar_tps: float | None) -> dict:
    outs = run["outs"]
    drafted, accepted, gammas = [], [], []
    verifications = acc = 0
    for o in outs:
        m = o.metrics
        verifications += m.verifications
        acc += m.accepted
        gammas += m.gamma_history
        for j, (d, a) in enumerate(zip(m.drafted_by_position, m.accepted_by_position,
                                       strict=True)):
            while len(drafted) <= j:
                drafted.append(0)
                accepted.append(0)
            drafted[j] += d
            accepted[j] += a
    tps = run["tokens"] / run["seconds"]
    hist = {g: gammas.count(g) for g in sorted(set(gammas))}
    return {
        "mode": mode, "tokens_per_s": tps, "decode_seconds": run["seconds"],
        "tokens": run["tokens"], "speedup_vs_ar": tps / ar_tps if ar_tps else None,  # no ar run
        "mean_accepted_length": (acc + verifications) / verifications if verifications else 1.0,
        "acceptance_rate": sum(accepted) / sum(drafted) if drafted and sum(drafted) else None,
        "acceptance_by_position": [a / d if d else None for a, d in zip(accepted, drafted,
                                                                         strict=True)],
        "gamma_histogram": hist, "gamma_mean": statistics.mean(gammas) if gammas else 0.0,
        "breakdown": run["breakdown"],
        "token_ids": [o.token_ids for o in outs],
        **({"by_domain": by_domain(outs, run["domains"])} if run.get("domains") else {}),
    }


def by_domain(outs, domains: list[str]) -> dict[str, dict]:
    """Per domain of a mixed workload: its requests' accepted length and draft length (the
    step times are shared, so throughput is the batch's alone)."""
    out = {}
    for domain in sorted(set(domains)):
        ms = [o.metrics for o, d in zip(outs, domains, strict=True) if d == domain]
        verifications = sum(m.verifications for m in ms)
        gammas = [g for m in ms for g in m.gamma_history]
        out[domain] = {
            "requests": len(ms), "tokens": sum(m.generated_tokens for m in ms),
            "mean_accepted_length": (sum(m.accepted for m in ms) + verifications) / verifications
            if verifications else 1.0,
            "gamma_mean": statistics.mean(gammas) if gammas else 0.0,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--modes", default=MODES)
    p.add_argument("--contexts", default="2048,4096,8000",
                   help="prompt lengths; 'short' = chat prompts asking for long answers; 'mix' = "
                        "the heterogeneous workload (workloads.heterogeneous_requests: code, "
                        "docs, prose, tables, HumanEval; lengths from --mix-contexts, new tokens "
                        "from --mix-max-tokens, not --max-tokens)")
    p.add_argument("--mix-contexts", default="4096,32768", help="'mix': prompt tokens, lo,hi")
    p.add_argument("--mix-max-tokens", default="256,2048", help="'mix': new tokens, lo,hi")
    p.add_argument("--batch", default="64",
                   help="requests decoded together; 'max': the most the KV pool holds (<= 1024)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature > 0 (0: off)")
    p.add_argument("--sampling-seed", default="0",
                   help="every request's SamplingParams.seed, or 'none': unseeded requests "
                        "(as most API calls; `aspire` moves their draft lengths to the verify "
                        "slots, where a seeded request keeps its own: DraftPolicy."
                        "keeps_its_target)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--max-batched-tokens", type=int, default=16384)
    p.add_argument("--dummy-shapes", choices=sorted(DUMMY_SHAPES), default=None,
                   help="random weights of this architecture, random-token prompts")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--prefill-sdpa", choices=("off", "on", "auto"), default="off",
                   help="prefill chunks through SDPA (AttentionConfig.prefill_sdpa; not in "
                        "deterministic modes): shorter runs, the same decode window")
    p.add_argument("--diagnose", action="store_true",
                   help="time each graph replay on the GPU (idle between replays, by phase) and "
                        "log synchronizing CUDA calls over each window: breakdown.gpu_clock, "
                        "breakdown.syncs")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after each window, this many engine steps under torch's profiler: "
                        "the GPU kernels by time (breakdown.kernels), outside the clock")
    p.add_argument("--profile-before", action="store_true",
                   help="profile those steps before the window instead (every row of the "
                        "batch still decoding, as in the window), not after it")
    p.add_argument("--window", choices=("steady", "drain"), default="steady",
                   help="stop the clock when the first (steady) or last (drain) request finishes")
    p.add_argument("--out", default=None)
    p.add_argument("--gamma", type=int, default=None,
                   help="draft length of the synchronized modes (default: SpecConfig's)")
    p.add_argument("--record-traces", default=None, metavar="PATH",
                   help="greedy: write every mode's acceptance traces for scripts/simulate.py "
                        "(several contexts: PATH must hold '{context}')")
    args = p.parse_args()
    modes = args.modes.split(",")
    if args.record_traces and (args.temperature != 0 or ("{context}" not in args.record_traces
                                                         and "," in args.contexts)):
        p.error("--record-traces: greedy only, and '{context}' in PATH for several contexts")
    extra = {"cuda_graphs": not args.no_cuda_graphs}
    if args.gamma is not None:
        extra["gamma"] = args.gamma
    if "mix" in args.contexts.split(",") and (args.dummy_shapes or args.batch == "max"):
        p.error("--contexts mix: real text and a numeric --batch (not --dummy-shapes, --batch max)")
    mix_ctx, mix_gen = (tuple(int(x) for x in v.split(","))
                        for v in (args.mix_contexts, args.mix_max_tokens))
    if args.dummy_shapes:
        if args.batch == "max":
            p.error("--batch max sizes the batch by the KV pool: not with --dummy-shapes")
        longest = max(int(c) for c in args.contexts.split(",") if c not in ("short", "mix"))
        pages_per_request = -(-(longest + args.max_tokens + 64) // 16)
        extra.update(model="dummy", load_format="dummy",
                     hf_overrides=DUMMY_SHAPES[args.dummy_shapes],
                     num_pages=(int(args.batch) + 4) * pages_per_request)
    report = {"args": vars(args), "results": []}
    if "mix" in args.contexts.split(","):  # the domains this machine has text for, and why not
        report["mix_domains"] = available_domains()
        for domain, why in report["mix_domains"].items():
            if why is not None:
                print(f"mix: domain {domain!r} left out: {why}", flush=True)
    for ctx in args.contexts.split(","):
        per_mode: dict[str, list[dict]] = {m: [] for m in modes}
        builds: dict[str, dict] = {}  # mode -> its LLM's start-up seconds, the pool's room
        traces = Traces({}, {}, [])
        batch = MAX_BATCH  # --batch max: the first mode's pool sets it for the context
        for mode in modes:
            _set_env(mode_env(mode))  # its kernel switches, for its build and runs (ENV_VARIANTS)
            kw = {"model": args.model, "load_format": args.load_format, **extra}
            if args.batch != "max":
                max_seqs = max(int(args.batch), 1)
            else:  # the first mode's pool sizes the batch; the others are built for that batch
                # (their graphs and step workspace for its rows, not MAX_BATCH's)
                max_seqs = batch
            spec_mode, options = mode_options(mode)
            if args.prefill_sdpa != "off" and not options.get("deterministic"):
                # prompts faster (the decode window is what is timed; never in det modes)
                options["attention_options"] = {**options.get("attention_options", {}),
                                                 "prefill_sdpa": args.prefill_sdpa}
            built = time.perf_counter()  # start-up: load, KV pool, calibration, captures
            llm = LLM(device=args.device, dtype=args.dtype, spec_mode=spec_mode,
                      attention_backend=args.attention_backend, max_num_seqs=max_seqs,
                      max_num_batched_tokens=args.max_batched_tokens, **options, **kw)
            builds[mode] = {"startup_s": time.perf_counter() - built}
            tok = llm.tokenizer
            holds = largest_batch(llm, ctx, args) if ctx not in ("short", "mix") else None
            if args.batch != "max":
                batch = int(args.batch)
            elif mode == modes[0]:  # every mode of a context decodes the same batch
                batch = holds if holds is not None else largest_batch(llm, ctx, args)  # refuses
            builds[mode]["pool_holds"] = holds
            # printed before the runs: a call cut short still says where its time went
            print(f"[{ctx} {mode}] start-up {builds[mode]['startup_s']:.0f} s; its KV pool "
                  f"holds {holds} requests of this context", flush=True)
            if holds is not None and batch > holds:  # a smaller pool than the first mode's
                print(f"[{ctx} {mode}] WARNING: batch {batch} > the {holds} requests its pool "
                      f"holds: the rest wait or are preempted, and the window measures that; "
                      f"list the mode with the most step workspace first, or pass --batch "
                      f"{holds}", flush=True)
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                    top_p=args.top_p, top_k=args.top_k,
                                    seed=None if args.sampling_seed == "none"
                                    else int(args.sampling_seed),
                                    ignore_eos=True)  # fmt: skip
            domains = None
            if args.dummy_shapes:
                prompts = random_prompts(batch, int(ctx), llm.engine.info.vocab_size)
            elif ctx == "short":
                prompts = short_prompts(tok, batch)
            elif ctx == "mix":
                work = heterogeneous_requests(tok, batch, seed=0, context_tokens=mix_ctx,
                                              max_tokens=mix_gen,
                                              max_total=llm.engine.max_model_len)  # fmt: skip
                prompts, domains = [w.prompt_ids for w in work], [w.domain for w in work]
                params = [dataclasses.replace(params, max_tokens=w.max_tokens) for w in work]
            else:
                prompts = long_context_prompts(tok, batch, int(ctx))
            # tuples, which the cyclic collector untracks: lists of 32k ids each, held through
            # the window, had every generation-2 collection visit each id (§8.60)
            prompts = [tuple(p) for p in prompts]
            warm = SamplingParams(max_tokens=WARMUP_TOKENS, temperature=args.temperature,
                                  top_p=args.top_p, top_k=args.top_k, ignore_eos=True)  # fmt: skip
            decode_run(llm, prompts[:WARMUP_REQUESTS], warm, f"warmup-{mode}")
            for rep in range(args.repeats):
                recorder = TraceRecorder(llm.engine) if args.record_traces and rep == 0 else None
                per_mode[mode].append(decode_run(llm, prompts, params, f"{ctx}-{mode}-{rep}",
                                                 args.window, args.diagnose,
                                                 args.profile_steps,
                                                 args.profile_before))  # fmt: skip
                per_mode[mode][-1]["domains"] = domains
                run = per_mode[mode][-1]  # progress: a run cut short still shows what it did
                print(f"[{ctx} {mode} rep {rep}] {run['tokens'] / run['seconds']:.1f} tok/s "
                      f"(start-up {builds[mode]['startup_s']:.0f} s, "
                      f"prefill {run['prefill_s']:.0f} s, "
                      f"run {run['wall_s']:.0f} s)", flush=True)
                if recorder is not None:
                    recorder.detach()
                    traces.add_run(mode, {}, per_mode[mode][-1]["outs"], recorder)
                    traces.meta = dict(engine_meta(llm.engine), context=ctx)
                    for rt, domain in zip(traces.requests, domains or [], strict=False):
                        rt.domain = domain
            info = llm.engine.info
            llm.shutdown()
            del llm
            gc.collect()
            _empty_cache()
            if args.out and mode != modes[-1]:  # a run cut short keeps the modes it measured
                done = context_results(per_mode, builds, ctx, info.device_name, args)
                with open(args.out, "w") as f:
                    json.dump(dict(report, results=report["results"] + done,
                                   partial=f"context {ctx}: the modes up to {mode}"), f, indent=1)
        for s in context_results(per_mode, builds, ctx, info.device_name, args):
            mode = s["mode"]
            report["results"].append(s)
            if mode in traces.modes:
                traces.modes[mode] = dict(s, gamma=llm_gamma(mode, args))
            print(f"ctx={ctx:>6} {mode:>13}: {s['tokens_per_s']:9.1f} tok/s  "
                  f"x{s['speedup_vs_ar'] or math.nan:.2f}  "
                  f"accepted/verify={s['mean_accepted_length']:.2f} "
                  f"match={s.get('greedy_token_match_vs_ar', '-')}", flush=True)
        if args.out:  # after every context: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
        if args.record_traces:
            traces.save(args.record_traces.format(context=ctx))


def context_results(per_mode: dict[str, list[dict]], builds: dict[str, dict], ctx: str,
                    device_name: str, args) -> list[dict]:
    """One context's summaries, in mode order, of the modes with runs (``per_mode``: mode ->
    its runs, the median run summarized; ``builds``: mode -> start-up seconds and the requests
    of this context its KV pool holds): every mode at the end, those measured so far when a
    partial JSON is written after each mode. Speedups against `ar`'s median where it ran."""
    done = [m for m, runs in per_mode.items() if runs]
    ar_runs = per_mode.get("ar")
    ar_tps = statistics.median(r["tokens"] / r["seconds"] for r in ar_runs) if ar_runs \
        else None
    median = {m: sorted(per_mode[m], key=lambda r: r["tokens"] / r["seconds"])[
        len(per_mode[m]) // 2] for m in done}  # fmt: skip
    summaries = {m: summarize(m, median[m], ar_tps) for m in done}
    for mode in done:
        # greedy match against `ar` of the same variant where the run has it ("ar/det" for
        # "aspire/det"), else against plain `ar`; environment variants left out, since they
        # keep the arithmetic ("ar/nopdl" against "ar": the same tokens)
        variant = "+".join(v for v in mode.partition("/")[2].split("+")
                           if v not in ENV_VARIANTS)  # fmt: skip
        ref = summaries.get(f"ar/{variant}" if variant else "ar", summaries.get("ar"))
        if ref is not None and args.temperature == 0:
            summaries[mode]["greedy_token_match_vs_ar"] = _match_rate(
                summaries[mode]["token_ids"], ref["token_ids"])  # fmt: skip
    for mode in done:
        s = summaries[mode]
        s.update(context=ctx, batch=len(s["token_ids"]), device=device_name,
                 startup_s=builds[mode]["startup_s"], pool_holds=builds[mode]["pool_holds"],
                 prefill_s=median[mode]["prefill_s"],
                 run_wall_s=median[mode]["wall_s"])  # fmt: skip
        del s["token_ids"]
    return [summaries[m] for m in done]


def llm_gamma(mode: str, args) -> int | None:
    """The fixed draft length a mode ran with (None: per request)."""
    spec_mode, options = mode_options(mode)
    if spec_mode not in ("magicdec", "specattn", "aspire_fixed"):
        return None
    return options.get("gamma") or args.gamma or SpecConfig().gamma


def largest_batch(llm: LLM, ctx: str, args) -> int:
    """The most requests of this context (plus their new tokens and drafts) the pool holds."""
    if ctx == "short":
        raise SystemExit("--batch max needs numeric contexts")
    engine = llm.engine
    tokens = int(ctx) + args.max_tokens + engine.cfg.spec.d_max + 2
    per_request = -(-tokens // engine.cfg.cache.page_size)
    return max(1, min(MAX_BATCH, engine.blocks.num_free // per_request))


def _match_rate(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of positions, up to each pair's first divergence included, that agree."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        n = min(len(x), len(y))
        k = next((i for i in range(n) if x[i] != y[i]), n)
        same += k
        total += n
    return same / total if total else 1.0


def _empty_cache() -> None:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


if __name__ == "__main__":
    main()
