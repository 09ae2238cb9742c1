"""Engine configuration: one frozen dataclass per concern, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

DTYPES = ("float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")
CALIBRATE = ("auto", "off", "force")
GAMMA_RULES = ("none", "fixed", "fsm", "cost_model")  # draft-length rules (spec/draft_policy.py)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class ModeSpec:
    """What one speculation mode means (DESIGN.md §1.6): a row of ``MODES``. Every module reads
    these fields; none compares mode names."""

    # which pages a draft row attends to, a name in worker/page_policies' PAGE_POLICIES:
    # "window" (the sink page plus the most recent pages, StreamingLLM), "topk" (top-scoring
    # pages plus the sink and the recent ones); "none": the mode never drafts
    page_policy: str
    # draft rows run the refresh layer over every page and re-score the pages; False: the
    # scores come from the last verification only
    refresh_while_drafting: bool
    # the whole batch drafts, then the whole batch verifies (a request idles while it waits);
    # False: each request verifies when its own target is reached
    synchronized: bool
    # draft length before a verification: "none" (0), "fixed" (SpecConfig.gamma), "fsm" (+1
    # after a full acceptance, -1 after a rejection, in [fsm_min, fsm_max]), "cost_model"
    # (gamma_i from alpha_i and the cost model's c_i)
    gamma_rule: str

    def __post_init__(self) -> None:
        _require(bool(self.page_policy), "page_policy must name a policy or be 'none'")
        _require(self.gamma_rule in GAMMA_RULES,
                 f"gamma_rule must be one of {GAMMA_RULES}, got {self.gamma_rule!r}")
        _require((self.page_policy == "none") == (self.gamma_rule == "none"),
                 f"a mode drafts over pages or not at all, got page_policy "
                 f"{self.page_policy!r} with gamma_rule {self.gamma_rule!r}")
        _require(not self.refresh_while_drafting or self.speculative,
                 "refresh_while_drafting needs draft rows, got gamma_rule 'none'")
        _require(not self.synchronized or self.speculative,
                 "a mode without drafts has no synchronized rounds")

    @property
    def speculative(self) -> bool:
        return self.gamma_rule != "none"

    @property
    def reads_cost_model(self) -> bool:
        """Whether the schedule reads the cost model (start-up calibration pays off)."""
        return self.gamma_rule == "cost_model"


# DESIGN.md §1.6, one row per mode: a new mode is one row here (a new page policy: one file in
# worker/page_policies/ and its PAGE_POLICIES entry, named by the row).
MODES: dict[str, ModeSpec] = {
    #                         page_policy  refresh_while_drafting  synchronized  gamma_rule
    "ar":           ModeSpec("none",      False,                  False,        "none"),
    "magicdec":     ModeSpec("window",    False,                  True,         "fixed"),
    "specattn":     ModeSpec("topk",      False,                  True,         "fixed"),
    "aspire_fixed": ModeSpec("topk",      True,                   True,         "fixed"),
    "aspire_fsm":   ModeSpec("topk",      True,                   False,        "fsm"),
    "aspire":       ModeSpec("topk",      True,                   False,        "cost_model"),
}  # fmt: skip
SPEC_MODES = tuple(MODES)


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    # Pool size: explicit page count wins; else a byte budget; else a fraction of the GPU
    # memory free after the weights, less the largest steps' workspace, measured at start-up
    # (worker/kv_budget.py; cuda), or 1 GiB (cpu).
    num_pages: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.85

    def __post_init__(self) -> None:
        _require(self.page_size >= 1 and self.page_size & (self.page_size - 1) == 0,
                 f"page_size must be a power of two >= 1, got {self.page_size}")
        _require(self.num_pages is None or self.num_pages >= 2,
                 f"num_pages must be >= 2, got {self.num_pages}")
        _require(0.0 < self.gpu_memory_utilization <= 1.0,
                 f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # query tokens per step (prefill chunks + decode rows)
    max_model_len: int | None = None  # defaults to the model's max positions
    # Admission keeps room for the running requests (vLLM's watermark, made exact): a waiting
    # request is admitted only while the free pages cover what every running request and the
    # new one lack for their whole prompt plus this many more tokens, so that decoding does
    # not preempt and recompute whole prompts (32k tokens each in the largest-batch run of
    # issue 15). None: the most tokens one plan adds (SpecConfig.plan_growth_tokens); 0: only
    # the new row's pages are checked (preemption makes room later).
    admission_headroom_tokens: int | None = None

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(self.admission_headroom_tokens is None or self.admission_headroom_tokens >= 0,
                 f"admission_headroom_tokens must be >= 0, got {self.admission_headroom_tokens}")
        _require(self.max_num_batched_tokens >= 32,
                 f"max_num_batched_tokens must be >= 32, got {self.max_num_batched_tokens}")


# verify slots every second step where no query tile sets them (SpecConfig.verify_quantum)
DEFAULT_VERIFY_QUANTUM = 2


@dataclass(frozen=True)
class SpecConfig:
    """Speculation settings (DESIGN.md §1). Defaults follow the paper."""

    mode: str = "ar"
    k_min: int = 32  # min sparse pages
    rho: float = 0.07  # sparse fraction of pages
    recent_pages: int = 8  # L: most recent pages always in S_i
    keep_sink_page: bool = True  # the first page (attention sink) is always in S_i
    refresh_layer: int | None = None  # l_r; None -> num_layers - 2
    # The refresh layer while drafting, against the mode's row of MODES (None: the mode's,
    # DESIGN.md §1.6). False: pages re-chosen at verifications only, as specattn does, so that
    # `aspire` drafts as cheaply (the full read and rescoring at l_r were ~0.43 ms of an
    # aspire_fixed/g8 draft step's 2.03 at 32k x 64 on an H200, docs/benchmarks.md §8.50; on
    # an H100 at Qwen's shape the draft graph took 1.864 ms without it against 2.389, §8.53);
    # True: a scored mode of no refresh with it. For a measurement of what refreshing buys
    # (bench variants `norefresh`, `refresh`); the modes' meaning is unchanged.
    draft_refresh: bool | None = None
    gamma: int = 5  # fixed draft length of the synchronized modes
    d_max: int = 16
    gamma_init: int = 3  # drafts before a request's first verification (aspire)
    alpha_init: float = 0.8  # initial acceptance estimate (aspire, aspire_fsm)
    alpha_ema: float = 0.8  # the weight each verification leaves to the earlier ones
    # "pooled": alpha = (EMA of drafts accepted) / (EMA of drafts tried, the rejected one
    # included), the estimate whose expectation is the acceptance rate; "per_round": DESIGN.md
    # §1.5's alpha <- ema * alpha + (1 - ema) * a / min(a + 1, d), which sits 0.06-0.15 below
    # it and pulls gamma down with it (docs/speculation.md)
    alpha_estimator: str = "pooled"
    # How `aspire` prices a draft length (gamma_rule "cost_model"). "homogeneous": DESIGN.md
    # §1.5's c_i, a batch of B copies of the request, so each request is charged the whole
    # per-step term b_model of its draft steps. "marginal": each request's rows at what they add
    # to a step (b_tok and b_kv terms), the per-step term shared by the batch, against the
    # batch's own throughput (docs/speculation.md): the same choice for a homogeneous batch, a
    # better one for a mixed batch in the simulator.
    gamma_pricing: str = "marginal"
    # Modes where each request verifies at its own pace: verifications fall on every
    # verify_quantum-th decode step only (a "slot"): each request's draft length is moved to the
    # nearest one whose next verification lands on a slot (``DraftPolicy.align``), so that
    # requests in phase keep draft lengths of k * verify_quantum - 1 and the steps between the
    # slots hold draft rows only. A step mixing verify rows (the whole KV, every query in the
    # widest tile) with draft rows cost more than the two apart: on real Qwen2.5-Coder-0.5B at
    # 32k, batch 64, every request at gamma 8 in phase ran 3.05 ms a step where `aspire`'s
    # scattered verifications ran 3.60 (docs/benchmarks.md §8.28). 2 by default: on the real
    # Qwen2.5-Coder-0.5B at 32k x 64 on an H100, slots every 2 / 3 / 4 steps gave `aspire`
    # 0.970x / 0.951x / 0.930x aspire_fixed/g8 in one run, and SmolLM2 at 8k 1.005x / 0.985x /
    # 0.982x (§8.42), as the simulator predicted (§8.41: in phase Q = 2 allows 1, 3, 5, 7, ...
    # drafts, closer to each request's choice than Q = 4's 3, 7, 11); no slots gave 0.867x
    # (§8.39). 1: no slots. None (the default since session 47): the attention's query tile
    # (``DraftPolicy``'s query_tile, the queries of a row that share one KV read) where it is
    # 2 to d_max + 1 queries, else 2: rows in phase then draft tile - 1, the longest draft
    # whose verification reads its KV once, where Q = 2 rounds Qwen2.5's 8 (a 9-query tile)
    # down to 7. On the real Qwen2.5-Coder-0.5B at 32k x 256 new tokens on an H100, Q = 9
    # ran 1.053x / 1.055x Q = 2 at batch 160 / 64, and 1.096x / 1.029x specattn/g8, whose
    # steady rounds do the same GPU work (its lead: specattn's window-end round, §8.60).
    verify_quantum: int | None = None
    # With verify slots: seeded sampled requests' draft lengths move to the slots too. Off by
    # default: a sampled request's tokens follow its draft lengths (a verification's last draw
    # is not a draft's), so with it a seeded request's text also depends on the step it arrived
    # at. Sampled requests without a seed promise no text and take the slots either way.
    # `aspire`'s cost-model lengths already depend on the batch (docs/speculation.md), and
    # greedy rows gained 10% from the slots (docs/benchmarks.md §8.39, §8.42): to be timed.
    slot_sampled: bool = False
    # Sampled requests draft and verify on one noise: a draft is raced over q on the TARGET
    # stream at the position it fills, a verification takes the target's own race at each
    # position and keeps the drafts that equal it (``rejection_sampler.verify_coupled_batch``).
    # The text is then p's draws, token for token `ar`'s for a seeded request in every mode and
    # whatever the draft lengths (so sampled rows take the verify slots as greedy ones do), and
    # no draft's q is kept; a draft is accepted a little less often than by rejection sampling
    # where q differs from p (tests/test_coupled_sampling.py). Off until timed on a GPU.
    coupled_sampling: bool = False
    fsm_min: int = 1
    fsm_max: int = 16
    # aspire: a request whose target draft length stayed 0 for this many verifications drafts
    # one probe token, so that alpha and the cost model keep learning (gamma = 0 is never
    # absorbing; docs/speculation.md).
    probe_every: int = 16
    # Cost model: refit online every N decode steps (prefill chunks are not fitted; the first
    # refit comes as soon as two served steps are measured).
    refit_every: int = 64
    # Synchronized modes, greedy batches: once every request drafts, the draft steps left
    # before the verification run back to back as one plan (a draft chain): drafts commit
    # nothing, so those steps are known in advance, and the worker feeds each step's drafts
    # into the next on the device while it plans the next step; one host round trip per chain
    # instead of one per draft step.
    draft_chains: bool = True
    # With draft_chains: a chain that ends its round carries the round's verification in the
    # same plan (one host round trip per round; the worker plans the verification while the
    # GPU runs the chain). On an H200 with the draft-step graphs it made magicdec 10-28% and
    # aspire_fixed 7-20% faster (docs/benchmarks.md §8.6).
    chain_verify: bool = True
    # With chain_verify: in a greedy batch where every request starts a round (no pending
    # drafts), up to this many rounds run back to back in one plan, the worker starting each
    # from the last one's accepted tokens: one engine round trip (commit, stop checks,
    # scheduling) per this many rounds. Clients receive up to this many rounds' tokens at once.
    # 4 by default: with the rounds' verification planned on the device (worker/verify_graphs.py)
    # the plan's rounds replay back to back with one host sync; on real Qwen2.5-Coder-0.5B at
    # 32k, batch 64, 4 rounds per plan gave magicdec 1.51x -> 1.55x and aspire_fixed 1.28x ->
    # 1.44x `ar` in one run (docs/benchmarks.md §8.15).
    rounds_per_plan: int = 4
    # ar: once every request decodes (nothing in prefill, nobody waiting), this many decode
    # steps run back to back as one plan (a decode chain, as vLLM's multi-step scheduling):
    # each step's token feeds the next on the device, stop conditions apply when the chain
    # returns (tokens after a stop are dropped). One host round trip per chain instead of per
    # step; clients receive up to this many tokens at once. 1: one plan per step.
    ar_chain: int = 8
    # Modes where each request verifies at its own pace (aspire, aspire_fsm): in a greedy
    # batch where every request decodes and nobody waits, this many steps run as one plan (an
    # asynchronous run, ``RowPlan.async_gamma``): each request keeps the draft length chosen
    # when the plan starts, drafting until it holds that many and then verifying, every step
    # one forward of all rows. On a GPU the steps replay graphs that plan themselves on the
    # device (worker/async_graphs.py), one host sync per plan; the draft lengths see the
    # plan's verifications from the next plan on; clients receive a run's tokens at once.
    # 16 by default: on real Qwen2.5-Coder-0.5B at 32k, batch 64, 16 steps gave aspire 0.98x
    # `ar` against 0.65x with 1 and 0.90x with 32 (docs/benchmarks.md §8.17). 1: one plan
    # per step.
    async_steps: int = 16
    # Zero-bubble asynchronous runs (issue 14 item 2): on the GPU the worker starts this many
    # steps of the next run (the same rows, their promised draft lengths) before it waits for
    # the current run's tokens, so that the GPU works while the host commits, schedules and
    # plans. The next plan either matches what was started (rows may have finished; then it
    # continues on the device) or the started steps are dropped: their KV lies past every
    # row's exact tokens and is rewritten before it is read. 0: off.
    async_overlap_steps: int = 4  # at most async_steps of them are started
    # The same for greedy rounds of the synchronized modes (worker/round_runs.py): the worker
    # replays the next plan's first round before it waits for this plan's tokens.
    rounds_overlap: bool = True
    # And for `ar`'s greedy decode chains (worker/decode_chains.py): the next chain of the same
    # rows replays before the host has this chain's tokens (the host's ~2 ms a plan of commit,
    # scheduling and planning left the GPU idle between chains: docs/benchmarks.md §8.25).
    # Exact (tests/test_gpu_engine.py::test_decode_chains_started_early_on_gpu on the H200);
    # timed in §8.26: the GPU idle between decode steps 0.24 ms instead of 0.45, +3% and +4%
    # on random weights at 32k and SmolLM2 at 8k, -1.6% (noise) on Qwen2.5-Coder at 32k.
    # `bench_decode.py` variant "noaroverlap" turns it off.
    ar_overlap: bool = True

    @property
    def overlap_steps(self) -> int:
        """Steps of the next asynchronous run started early (``async_overlap_steps``)."""
        return min(self.async_overlap_steps, self.async_steps)

    def __post_init__(self) -> None:
        _require(self.mode in MODES,
                 f"spec_mode must be one of {tuple(MODES)}, got {self.mode!r}")
        _require(self.k_min >= 1, f"k_min must be >= 1, got {self.k_min}")
        _require(0.0 < self.rho <= 1.0, f"rho must be in (0, 1], got {self.rho}")
        _require(self.recent_pages >= 1, f"recent_pages must be >= 1, got {self.recent_pages}")
        _require(self.recent_pages + int(self.keep_sink_page) <= self.k_min,
                 f"k_min ({self.k_min}) must hold the {self.recent_pages} recent pages"
                 + (" and the sink page" if self.keep_sink_page else ""))
        _require(1 <= self.gamma <= 64, f"gamma must be in [1, 64], got {self.gamma}")
        _require(1 <= self.d_max <= 64, f"d_max must be in [1, 64], got {self.d_max}")
        _require(0 <= self.gamma_init <= self.d_max,
                 f"gamma_init must be in [0, d_max={self.d_max}], got {self.gamma_init}")
        _require(0.0 < self.alpha_init < 1.0,
                 f"alpha_init must be in (0, 1), got {self.alpha_init}")
        _require(0.0 <= self.alpha_ema < 1.0, f"alpha_ema must be in [0, 1), got {self.alpha_ema}")
        _require(self.verify_quantum is None or 1 <= self.verify_quantum <= 64,
                 f"verify_quantum must be None or in [1, 64], got {self.verify_quantum}")
        _require(self.gamma_pricing in ("homogeneous", "marginal"),
                 f"gamma_pricing must be 'homogeneous' or 'marginal', got {self.gamma_pricing!r}")
        _require(self.alpha_estimator in ("pooled", "per_round"),
                 f"alpha_estimator must be 'pooled' or 'per_round', got {self.alpha_estimator!r}")
        _require(1 <= self.fsm_min <= self.fsm_max <= 64,
                 f"need 1 <= fsm_min <= fsm_max <= 64, got {self.fsm_min}, {self.fsm_max}")
        _require(1 <= self.rounds_per_plan <= 64,
                 f"rounds_per_plan must be in [1, 64], got {self.rounds_per_plan}")
        _require(1 <= self.ar_chain <= 64, f"ar_chain must be in [1, 64], got {self.ar_chain}")
        _require(1 <= self.async_steps <= 64,
                 f"async_steps must be in [1, 64], got {self.async_steps}")
        _require(0 <= self.async_overlap_steps <= 64,
                 f"async_overlap_steps must be in [0, 64], got {self.async_overlap_steps}")
        _require(self.probe_every >= 1, f"probe_every must be >= 1, got {self.probe_every}")
        _require(self.draft_refresh in (None, True, False),
                 f"draft_refresh must be None, True or False, got {self.draft_refresh!r}")
        _require(not self.draft_refresh or self.mode_spec.page_policy == "topk",
                 f"draft_refresh needs a mode whose drafts read page scores (topk), got "
                 f"{self.mode!r} ({self.mode_spec.page_policy!r})")

    def sparse_budget(self, num_pages: int) -> int:
        """k_i = max(k_min, ceil(rho * P_i)) pages in S_i (DESIGN.md §1.1); the one formula the
        driver's cost model and the worker's page selection both use."""
        return max(self.k_min, math.ceil(self.rho * num_pages))

    def sparse_budgets(self, num_pages):
        """``sparse_budget`` of every entry of int64 [R] page counts, a numpy array (host) or a
        torch tensor (device) -> int64 [R] of the same kind; float64 like the scalar form, so
        the driver, the host and the device agree on every k_i."""
        if hasattr(num_pages, "double"):  # torch, without importing it here
            return (self.rho * num_pages.double()).ceil().long().clamp(min=self.k_min)
        return np.maximum(self.k_min, np.ceil(self.rho * num_pages).astype(np.int64))

    @property
    def mode_spec(self) -> ModeSpec:
        return MODES[self.mode]

    @property
    def speculative(self) -> bool:
        return self.mode_spec.speculative

    @property
    def synchronized(self) -> bool:
        return self.mode_spec.synchronized

    @property
    def refresh_while_drafting(self) -> bool:
        if self.draft_refresh is not None:
            return self.draft_refresh
        return self.mode_spec.refresh_while_drafting

    @property
    def plan_growth_tokens(self) -> int:
        """Most tokens one plan can add to a request's KV: a decode chain's ``ar_chain``
        steps, or ``rounds_per_plan`` rounds of at most drafts + 1 positions each (a fixed
        gamma's drafts, else up to max_drafts, and the verification's one more), or an
        asynchronous run's ``async_steps`` steps (each moves a request on by one position at
        most) and one more."""
        if not self.speculative:
            return self.ar_chain  # decode chains run in `ar` only
        drafts = self.round_drafts
        if not self.synchronized:
            return max(drafts + 1, self.async_steps + 1)
        return (drafts + 1) * self.rounds_per_plan

    @property
    def round_drafts(self) -> int:
        """Most drafts a request holds when it verifies: a fixed gamma's (clamped to
        max_drafts), else max_drafts (so the longest draft chain of a synchronized mode, all
        of which have a fixed gamma)."""
        if self.mode_spec.gamma_rule == "fixed":
            return min(self.gamma, self.max_drafts)
        return self.max_drafts

    def resolved_quantum(self, query_tile: int | None) -> int:
        """verify_quantum as set, or for None the query tile (queries of a row that share one
        KV read) where it holds 2 to d_max + 1 queries, else ``DEFAULT_VERIFY_QUANTUM``."""
        if self.verify_quantum is not None:
            return self.verify_quantum
        if query_tile is not None and 2 <= query_tile <= self.d_max + 1:
            return query_tile
        return DEFAULT_VERIFY_QUANTUM

    @property
    def max_drafts(self) -> int:
        """Most drafts a request may hold, whatever its gamma rule asks (gamma, fsm_max and
        the cost model's optimum are all clamped to it): d_max; 0 without drafts. A verify
        row has at most max_drafts + 1 queries."""
        return self.d_max if self.speculative else 0


TRITON_PROJECTIONS = ("o", "down")  # EngineConfig.triton_projections' names


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "float32"
    device: str = "cpu"
    tp_size: int = 1
    load_format: str = "auto"
    attention_backend: str = "auto"
    # Settings of the triton backend's kernels (kernels/attention_config.AttentionConfig
    # fields, e.g. {"concurrent_launches": False}); checked when the worker builds its backend.
    attention_options: dict = field(default_factory=dict)
    tokenizer: str | None = None  # defaults to the model's own
    # For load_format="dummy": a HF config (dict) or a path/alias whose config is used.
    hf_overrides: dict = field(default_factory=dict)
    seed: int = 0  # weights of dummy models
    # Cost-model calibration at start-up (engine/calibration.py): "auto" loads the cached fit
    # of this deployment or runs a short sweep (spec mode "aspire" only: the one that reads the
    # cost model); "force" always sweeps; "off" keeps the prior until the online refits.
    calibrate: str = "auto"
    # CUDA graphs (cuda, triton backend; tp > 1: tp_cuda_graphs): one graph per decode step,
    # piecewise graphs of the dense layers for steps with prefill rows; False: eager.
    cuda_graphs: bool = True
    # Token buckets of the graphs per doubling from FINE_BUCKETS_FROM tokens up (1, 2 or 4;
    # rows stay in powers of two): a step runs its dense layers over its bucket's tokens, so
    # a 64-row verification of 9 queries (576 tokens) computes 1,024 at 1, 768 at 2, 640 at
    # 4 (worker/cuda_graphs.buckets; docs/benchmarks.md §8.56). More buckets, more graphs
    # captured at start-up. 4 by default since §8.58: the 9-query verification costs 1.148x
    # and 1.151x an `ar` step (1.204x at 1; issue 14 asks <= 1.15x), rounds 1.8% and
    # `aspire` 0.9% faster at 32k x 64 (§8.57), for 4 s more start-up with Triton's compiled
    # kernels cached (31 s more without). Bench variants `bk1`, `bk2`, `bk4`.
    graph_buckets_per_octave: int = 4
    # With cuda_graphs at tp > 1: every shard captures the same graphs, their all-reduces,
    # all-gathers and the refresh layer's cross-rank max (NCCL) inside (issue 17). Off until
    # timed on two GPUs (scripts/bench_tp.py); off, shards run each step eagerly.
    tp_cuda_graphs: bool = False
    # With cuda_graphs and draft chains: each draft step of a chain is one graph that plans its
    # own page lists and work on the device (worker/draft_graphs.py); False: the host plans
    # each step and the scored policies' refresh layer runs eagerly between two graphs.
    draft_graphs: bool = True
    # With draft_graphs and chain_verify: a greedy round's verification is one graph that plans
    # itself on the device (worker/verify_graphs.py), so a plan's rounds replay back to back
    # with one host sync; False: the host plans each round's verification.
    verify_graphs: bool = True
    # The sampling variants of the self-planning graphs (an asynchronous run's steps, a
    # round's verification) captured at start-up beside the greedy ones, where the device
    # holds their store of the drafts' q (worker/device_memory.RowStore); False: each at its
    # first sampled use, a capture (~70 ms on an H100 at Qwen2.5-0.5B's shapes) inside a
    # running batch's steps.
    sampled_graphs_at_start: bool = True
    # The self-planning graphs plan their rows (tokens, page lists) and accept in one Triton
    # launch each (kernels/row_plan.py); False: the tensor ops of its reference, ~60-90 small
    # kernels a step (kept to measure the difference in one run).
    fused_row_planning: bool = True
    # Every row's logits bitwise independent of the batch, of the row's query count (decode,
    # draft, verify, prefill chunk) and of its place in the batch (issue 18): linear layers of
    # one tiling (tp/layers.invariant_linear), attention of one query tile and KV chunks of a
    # fixed size for every row (kernels/attention_config.DETERMINISTIC; the torch backend: each
    # query alone). Greedy output of every speculative mode then equals `ar`'s in bf16 too.
    deterministic: bool = False
    # Freeze Python's heap once the engine is built (engine/heap.py): no garbage collection
    # then visits the ~200k objects of start-up (~100 ms between two plans when one did, a CPU).
    gc_freeze: bool = True
    # While the worker executes a plan, Python's garbage collections that come due wait for
    # its waits on the device, where the queued GPU work hides them (worker/gc_waits.py): a
    # 10-20 ms generation-1 collection between two plans stalled the H200 (§8.36).
    gc_at_waits: bool = True
    # On a GPU, decode-sized steps run the qkv projection with RoPE and the KV store, and the
    # gate/up projection with SiLU-and-multiply, in one launch each (model/decoder.py
    # QKV_ROPE_MAX_TOKENS, GATE_UP_SILU_MAX_TOKENS); False: cuBLAS and the separate kernels.
    fused_epilogues: bool = True
    # On a GPU, decode-sized bf16 / fp16 steps at tp = 1 run each MLP (gate/up, SiLU, down) as
    # one launch, the down projection's sum over the intermediate finished by the next
    # RMSNorm (kernels/mlp_partials.py): a launch or two fewer a layer. Off until timed on a
    # GPU (bench_decode.py variant `fusedmlp`); never with `deterministic`.
    fused_mlp: bool = False
    # On a GPU, decode-sized bf16 / fp16 steps run these row-parallel projections ("o": the
    # attention's output projection, "down": the MLP's) through kernels/linear.py (Triton, one
    # tiling) instead of cuBLAS, so that with programmatic dependent launch (kernels/pdl.py)
    # every kernel of a layer overlaps its predecessor's drain: a cuBLAS launch waits for the
    # attention or the SiLU to complete and flush. Alone the Triton o projection took 3.54 us
    # against cuBLAS's 4.52 at 64 rows, the down projection 10.33 against 7.92 (H200, Qwen's
    # shapes, docs/benchmarks.md §8.28). Off until timed in a step (bench variants `tlo`,
    # `tldown`, `tlod`); never with `deterministic` (its projections are all Triton already).
    triton_projections: tuple[str, ...] = ()
    # Steps of an asynchronous run that hold draft rows only replay a lean graph: attention
    # one launch a layer of the one-query tile (the full graph's second launch, verify rows'
    # wide tile, would run empty), and in a mode that rescores pages at verifications only
    # (``SpecConfig.draft_refresh`` False) no refresh-layer split, log-sum-exp or rescoring
    # (they would score no row there): the same tokens and scores, fewer launches
    # (worker/async_graphs.py). At Qwen2.5-0.5B's 32k x 64 without the refresh such a step
    # cost 1.877 ms full, 1.816 lean (both savings together), the rounds' draft step 1.815
    # (docs/benchmarks.md §8.56). False: every step the full graph (bench variant `nolean`).
    async_lean_steps: bool = True
    # How the host waits for a graph run's tokens (worker/device_result.py): "event", a CUDA
    # event sync behind them; "spin", polling a flag that a second copy writes into pinned
    # memory after them (no CUDA call in the wait). Timed in docs/benchmarks.md §8.34 (H100,
    # random weights): the event wait already wakes 0.25 ms after the tokens; spin +0.3%.
    device_wait: str = "event"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.load_format in LOAD_FORMATS,
                 f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        _require(self.tp_size >= 1, f"tp_size must be >= 1, got {self.tp_size}")
        _require(isinstance(self.attention_options, dict)
                 and all(isinstance(k, str) for k in self.attention_options),
                 f"attention_options must map setting names to values, "
                 f"got {self.attention_options!r}")  # fmt: skip
        object.__setattr__(self, "triton_projections", tuple(self.triton_projections))
        _require(set(self.triton_projections) <= set(TRITON_PROJECTIONS),
                 f"triton_projections must name projections of {TRITON_PROJECTIONS}, got "
                 f"{self.triton_projections!r}")  # fmt: skip
        _require(self.graph_buckets_per_octave in (1, 2, 4),
                 f"graph_buckets_per_octave must be 1, 2 or 4, got "
                 f"{self.graph_buckets_per_octave!r}")  # fmt: skip
        _require(self.device_wait in ("event", "spin"),
                 f"device_wait must be 'event' or 'spin', got {self.device_wait!r}")
        _require(self.calibrate in CALIBRATE,
                 f"calibrate must be one of {CALIBRATE}, got {self.calibrate!r}")
        _require(self.device.split(":")[0] in ("cpu", "cuda"),
                 f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        # a verify row of max_drafts drafts (max_drafts + 1 tokens) must fit in one step's token
        # budget, else it is never scheduled and the engine spins
        budget = self.scheduler.max_num_batched_tokens
        _require(self.spec.max_drafts + 1 <= budget,
                 f"d_max + 1 ({self.spec.d_max + 1}, d_max={self.spec.d_max}) must not exceed "
                 f"max_num_batched_tokens ({budget}): a verify row of d_max drafts would never "
                 "fit in a step")


def build_engine_config(model: str = "smollm2-135m-instruct", *, spec_mode: str = "ar",
                        **kwargs) -> EngineConfig:
    """Flat keyword arguments (as users pass them) -> the composed EngineConfig."""
    spec = {k: kwargs.pop(k) for k in list(kwargs) if k in _SPEC_KEYS}
    cache = {k: kwargs.pop(k) for k in list(kwargs) if k in _CACHE_KEYS}
    sched = {k: kwargs.pop(k) for k in list(kwargs) if k in _SCHED_KEYS}
    unknown = set(kwargs) - set(EngineConfig.__dataclass_fields__)
    if unknown:
        raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
    return EngineConfig(model=model, spec=SpecConfig(mode=spec_mode, **spec),
                        cache=CacheConfig(**cache), scheduler=SchedulerConfig(**sched), **kwargs)


_SPEC_KEYS = {f for f in SpecConfig.__dataclass_fields__ if f != "mode"}
_CACHE_KEYS = set(CacheConfig.__dataclass_fields__)
_SCHED_KEYS = set(SchedulerConfig.__dataclass_fields__)
