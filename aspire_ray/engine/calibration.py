"""Start-up calibration of the step-time cost model on the real executor (DESIGN.md §1.5).

tau = b_model + b_tok * n_tokens + b_kv * kv_tokens_read depends on the deployment (model, GPU,
TP degree: all-reduce cost per token, dtype, page size), so it is measured, never configured:
a short sweep of synthetic requests runs through the engine's own executor at start-up.

The sweep, per context length c (pages borrowed from the engine's BlockManager, returned after):
  1. prefill B_max requests of c random tokens (not timed; no sampling);
  2. one untimed draft step and one untimed verify step (first-call costs: allocation, JIT);
  3. for each batch size B: timed draft steps (B draft rows over their sparse pages) and timed
     verify steps with d drafts per row (B rows of d + 1 tokens over all c + d + 1 tokens).
Each timed step (run ``repeats`` times, the median kept) gives a sample (n_tokens,
kv_tokens_read, worker step seconds), with the features computed exactly as the engine does
online (``DraftPolicy.step_features``: draft rows read |S_i|, and the full list at the refresh
layer where the policy refreshes while drafting). The synthetic requests use fresh ids and are
dropped from the workers afterwards.

The fit of the sweep is the cost model's calibrated prior: in force from the start, and where
an online refit is poor, the model falls back to it. It is cached as JSON under
``cache_root()/calibration/``, keyed by the deployment; a later start refits the cached samples
(under this start's physics bounds) instead of sweeping, and the samples seed the online window
(so online refits start well-conditioned); the engine keeps refitting every ``refit_every``
steps.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from aspire_ray.config import EngineConfig
from aspire_ray.executor import Executor
from aspire_ray.model.cache import cache_root
from aspire_ray.plan import RowKind, RowPlan, SamplingSpec, ShardInfo, StepOutput, StepPlan
from aspire_ray.spec.cost_model import CostCoefficients, CostModel
from aspire_ray.spec.draft_policy import DraftPolicy

from .block_manager import BlockManager


class CalibratedEngine(Protocol):
    """What calibration reads of the engine it calibrates (``engine.LLMEngine`` is one): it
    runs steps through the executor on pages of the pool and fits the cost model."""

    cfg: EngineConfig
    info: ShardInfo
    executor: Executor
    blocks: BlockManager
    policy: DraftPolicy
    cost_model: CostModel
    max_model_len: int

# 2: samples are whole worker steps (StepTimings.total), not the forward;
# 3: a draft row's kv_tokens include its refresh-layer full-list read (KVReads);
# 4: a verify row's kv_tokens count one read per query tile of its queries
FORMAT_VERSION = 4
_GREEDY = SamplingSpec(temperature=0.0, top_k=0, top_p=1.0, seed=0)


@dataclass(frozen=True)
class Sweep:
    """The grid of one calibration sweep."""

    contexts: tuple[int, ...]  # tokens per synthetic request
    batches: tuple[int, ...]  # rows per timed step
    drafts: tuple[int, ...] = (0, 2, 6)  # d of timed verify rows (d + 1 query tokens each)
    draft_steps: int = 2  # timed draft steps per (context, batch)
    repeats: int = 3  # each timed step runs this often; the sample is the median (noise)
    max_prefill_tokens: int = 4096  # B_max * context is capped by this (prefill cost)
    chunk_tokens: int = 1024  # tokens per untimed prefill step

    def __post_init__(self) -> None:
        if not self.contexts or not self.batches or min(self.contexts + self.batches) < 1:
            raise ValueError(f"a sweep needs positive contexts and batches, got {self}")


# Tiny models on CPU: well under 2 s. GPUs: long contexts, where the KV term shows.
CPU_SWEEP = Sweep(contexts=(48, 320), batches=(1, 6))
GPU_SWEEP = Sweep(contexts=(512, 2048, 8192), batches=(1, 8, 32), drafts=(0, 3, 7, 15),
                  max_prefill_tokens=65536, chunk_tokens=8192)


@dataclass
class CalibrationResult:
    source: str  # "sweep" | "cache"
    path: str
    seconds: float  # wall time of the calibration (sweep or load)
    coefficients: CostCoefficients
    samples: list[tuple[float, float, float]] = field(repr=False, default_factory=list)


def deployment_key(engine: CalibratedEngine) -> dict:
    """What the coefficients depend on (DESIGN.md §1.5: model, GPU, TP degree, dtype, page size,
    plus the sparse budget that sets draft rows' KV reads)."""
    cfg = engine.cfg
    return {
        "version": FORMAT_VERSION,
        "model": cfg.model,
        "load_format": cfg.load_format,
        "hf_overrides": json.dumps(cfg.hf_overrides, sort_keys=True, default=str),
        "device_name": engine.info.device_name,
        "tp_size": cfg.tp_size,
        "dtype": cfg.dtype,
        "attention_backend": cfg.attention_backend,
        "attention_options": json.dumps(cfg.attention_options, sort_keys=True, default=str),
        "page_size": cfg.cache.page_size,
        "k_min": cfg.spec.k_min,
        "rho": cfg.spec.rho,
        "refresh_while_drafting": cfg.spec.refresh_while_drafting,
    }


def cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in
                   Path(str(key["model"])).name)[:40]
    return cache_root() / "calibration" / f"{name}-tp{key['tp_size']}-{digest}.json"


def calibrate(engine: CalibratedEngine, mode: str | None = None,
              sweep: Sweep | None = None) -> CalibrationResult | None:
    """Load or measure the cost model of this deployment into ``engine.cost_model``.

    mode: "auto" (cache, else sweep; only in a spec mode whose schedule reads the cost model,
    ``ModeSpec.reads_cost_model``: aspire), "force" (sweep in any mode, overwrite the cache),
    "off" (nothing).
    """
    mode = mode or engine.cfg.calibrate
    if mode == "off" or (mode == "auto" and not engine.cfg.spec.mode_spec.reads_cost_model):
        return None
    t0 = time.perf_counter()
    key = deployment_key(engine)
    path = cache_path(key)
    if mode == "auto":
        cached = _load(path, key)
        if cached is not None:
            samples = [tuple(s) for s in cached["samples"]]
            _feed(engine, samples)
            return CalibrationResult("cache", str(path), time.perf_counter() - t0,
                                     engine.cost_model.coef, samples)
    if sweep is None:
        sweep = GPU_SWEEP if engine.cfg.device.startswith("cuda") else CPU_SWEEP
    samples = SweepRunner(engine, sweep).run()
    if _feed(engine, samples):
        _save(path, key, engine.cost_model.coef, samples)
    return CalibrationResult("sweep", str(path), time.perf_counter() - t0,
                             engine.cost_model.coef, samples)


def _feed(engine: CalibratedEngine, samples: list) -> bool:
    """Seed the online window with the samples; their fit becomes the prior. Where the sweep
    cannot pin down the KV term (on a GPU its short contexts are mostly per-step overhead:
    r2 0.27-0.70 on an H200), the prior takes the physical KV rate and fits the other two
    terms to the sweep. False if neither was possible (the prior stays as it was)."""
    model = engine.cost_model
    for n, kv, s in samples:
        model.add_sample(n, kv, s)
    coef = model.fit()
    if not model.fitted:
        physical = model.bounds.physical_prior()
        if physical is None or not samples:
            # no offset fit on the sweep's own steps either: the prior stays in force
            model.coef, model.status = model.prior, model.status.replace("offset:", "prior:")
            return False
        coef = model.fit_terms(np.array(samples, dtype=float), (True, True, False), physical)
        model.status = f"prior: sweep with the physical KV rate ({model.status})"
    model.set_prior(coef)
    return True


def _load(path: Path, key: dict) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key:
        return None
    return data


def _save(path: Path, key: dict, coef: CostCoefficients, samples: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"key": key, "created": time.time(),
            "coefficients": {"b_model": coef.b_model, "b_tok": coef.b_tok, "b_kv": coef.b_kv,
                             "r2": coef.r2, "samples": coef.samples},
            "samples": [list(s) for s in samples]}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)  # atomic: concurrent starts never read half a file


class SweepRunner:
    """Drives synthetic requests through the executor; returns (n_tokens, kv_tokens, s) samples.

    Also usable on its own (scripts/bench_orchestration.py builds steps with ``requests`` and
    ``decode_plan``).
    """

    def __init__(self, engine: CalibratedEngine, sweep: Sweep) -> None:
        self.engine = engine
        self.sweep = sweep
        self.executor = engine.executor
        self.blocks = engine.blocks
        self.policy = engine.policy
        self.page_size = engine.cfg.cache.page_size
        # verify rows as long as the deployment's own (longer ones would run outside its
        # whole-step graphs and time another step kind)
        self.drafts = sorted({min(d, engine.cfg.spec.max_drafts) for d in sweep.drafts})
        self.d_max = max(self.drafts)
        self._rng = random.Random(0)
        self._step_id = 0
        self._owned: dict[str, list[int]] = {}  # synthetic req id -> pages
        self._vocab = engine.info.vocab_size
        self.drafting = engine.cfg.spec.speculative  # "ar" workers have no draft page policy

    def run(self) -> list[tuple[float, float, float]]:
        samples: list[tuple[float, float, float]] = []
        try:
            for ctx in self._contexts():
                b_max = self._batch_cap(ctx)
                batches = sorted({min(b, b_max) for b in self.sweep.batches})
                ids = self.requests(ctx, b_max)
                if self.drafting:
                    self._execute(self.draft_plan(ids, ctx))  # warm-up, untimed
                self._execute(self.verify_plan(ids, ctx, self.d_max))
                for b in batches:
                    for _ in range(self.sweep.draft_steps if self.drafting else 0):
                        samples.append(self._timed(self.draft_plan(ids[:b], ctx)))
                    for d in self.drafts:
                        samples.append(self._timed(self.verify_plan(ids[:b], ctx, d)))
                self.release()
        finally:
            self.release()
        return samples

    # ---- sizing ------------------------------------------------------------------------------
    def _pages_per_request(self, ctx: int) -> int:
        return math.ceil((ctx + 1 + self.d_max) / self.page_size)

    def _contexts(self) -> list[int]:
        limit = self.engine.max_model_len - self.d_max - 2
        ok = [c for c in self.sweep.contexts if 1 <= c <= limit
              and self._pages_per_request(c) <= self.blocks.num_free]
        return ok or [min(max(limit, 1), 16)]

    def _batch_cap(self, ctx: int) -> int:
        by_pages = self.blocks.num_free // self._pages_per_request(ctx)
        by_tokens = max(1, self.sweep.max_prefill_tokens // ctx)
        return max(1, min(max(self.sweep.batches), by_pages, by_tokens,
                          self.engine.cfg.scheduler.max_num_seqs))

    # ---- synthetic requests ------------------------------------------------------------------
    def requests(self, ctx: int, n: int) -> list[str]:
        """Admit n synthetic requests of ctx random tokens and prefill them (untimed)."""
        ids = [f"__calibration-{ctx}-{i}-{self._rng.getrandbits(32):08x}" for i in range(n)]
        for rid in ids:
            self._owned[rid] = self.blocks.allocate(rid, self._pages_per_request(ctx))
        chunk = self.sweep.chunk_tokens
        new = {rid: _GREEDY for rid in ids}
        rows: list[RowPlan] = []
        budget = chunk
        for rid in ids:
            tokens = [self._rng.randrange(self._vocab) for _ in range(ctx)]
            start = 0
            while start < ctx:
                if budget == 0:
                    self._execute(StepPlan(self._next_id(), rows, new))
                    rows, new, budget = [], {}, chunk
                n_tok = min(ctx - start, budget)
                keep = 0 if start == 0 else len(self._owned[rid])
                pages = self._owned[rid] if start == 0 else []
                rows.append(RowPlan(rid, RowKind.PREFILL, tokens[start : start + n_tok], start,
                                    keep, list(pages), sample=False))
                start += n_tok
                budget -= n_tok
        if rows:
            self._execute(StepPlan(self._next_id(), rows, new))
        return ids

    def draft_plan(self, ids: list[str], ctx: int) -> StepPlan:
        """One draft row per request: input at position ctx, sparse attention."""
        rows = [self._row(rid, RowKind.DRAFT, [self._token()], ctx) for rid in ids]
        return StepPlan(self._next_id(), rows)

    def verify_plan(self, ids: list[str], ctx: int, drafts: int) -> StepPlan:
        """One verify row of d drafts per request (d = 0: a plain decode step)."""
        rows = [self._row(rid, RowKind.VERIFY, [self._token() for _ in range(drafts + 1)], ctx,
                          num_drafts=drafts) for rid in ids]
        return StepPlan(self._next_id(), rows)

    def release(self) -> None:
        """Drop the synthetic requests from the workers and return their pages."""
        if not self._owned:
            return
        dropped = list(self._owned)
        for rid, pages in self._owned.items():
            self.blocks.free(rid, pages)
        self._owned = {}
        self._execute(StepPlan(self._next_id(), [], {}, dropped))

    # ---- helpers -----------------------------------------------------------------------------
    def _row(self, rid: str, kind: RowKind, tokens: list[int], start: int,
             num_drafts: int = 0) -> RowPlan:
        n = len(self._owned[rid])
        return RowPlan(rid, kind, tokens, start, n, [], num_drafts=num_drafts)

    def _token(self) -> int:
        return self._rng.randrange(self._vocab)

    def _next_id(self) -> int:
        self._step_id -= 1  # negative: never confused with the scheduler's steps
        return self._step_id

    def _execute(self, plan: StepPlan) -> StepOutput:
        return self.executor.execute(plan)

    def features(self, plan: StepPlan) -> tuple[int, float]:
        """(n_tokens, kv_tokens_read) exactly as the engine records them online."""
        return self.policy.step_features(plan.rows)

    def _timed(self, plan: StepPlan) -> tuple[float, float, float]:
        times = sorted(self._execute(plan).timings.total
                       for _ in range(self.sweep.repeats))
        n, kv = self.features(plan)
        return float(n), float(kv), float(times[len(times) // 2])
