"""Scheduler simulator: replays recorded acceptance traces under measured step costs.

The engine itself runs (LLMEngine, Scheduler, DraftPolicy, CostModel: the code that serves),
over a worker stand-in that answers each verification from the trace (traces.py) and charges
each step the time of a step-cost model. So the schedule simulated is the engine's own, for
every mode and any fixed gamma, on the CPU in seconds; a change to the policy is simulated by
running the changed engine.

    python scripts/bench_decode.py ... --modes ar,magicdec,specattn,aspire_fixed,aspire \
        --gamma 16 --record-traces traces.json          # record (a real greedy run)
    python scripts/simulate.py --traces traces.json --costs docs/bench_decode_h200_chains.json \
        --cost-mode ar --measured docs/bench_decode_h200_chains.json

Step costs (``StepCosts``): the worker's time of a step is the engine's three-term model
b_model + b_tok * n_tokens + b_kv * kv_tokens over the engine's own features
(``DraftPolicy.step_features``); a draft step inside a draft chain costs ``chain_b_model``
instead of b_model (the host round trip a chain saves); a step of an asynchronous run that
holds verify and draft rows adds ``b_mixed`` (``--mixed-step-ms``; 0 by default); the first
steps of the next run that the worker starts early (``async_overlap_steps``, with the draft
lengths the run promised) cost their time again where the next plan does not continue them
(a draft length or run length that changed, a request that left: ``Started.mismatch``;
``early_steps_dropped`` counts them); the driver adds ``host_per_plan`` per plan (scheduling,
commit, the benchmark loop). ``--costs`` takes
the coefficients as JSON, an engine's ``stats()`` (or its ``cost_model``), a bench_decode JSON
(per mode: its ``breakdown``'s fit, or, where it kept its prior, its measured steps:
``costs_from_steps``), a trace file (its recorded modes' measurements) or a bench_floor JSON
(the three terms fitted to its steps by the engine's CostModel).

Predicted tokens/s is committed tokens over simulated decode time, in bench_decode's window
("steady": until the first request finishes).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass, replace

from bench_decode import (
    DUMMY_SHAPES,
    WARMUP_REQUESTS,
    WARMUP_TOKENS,
    _diff,
    mode_options,
    prefill_batch,
    summarize,
    window_delta,
    window_state,
)
from traces import Traces, policy_of, read_json

from aspire_ray import SamplingParams
from aspire_ray.config import SpecConfig
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.executor.base import Executor
from aspire_ray.llm import build_engine_config
from aspire_ray.plan import (
    RowKind,
    RowPlan,
    RowResult,
    ShardInfo,
    StepOutput,
    StepPlan,
    StepTimings,
)
from aspire_ray.spec.cost_model import CostCoefficients, CostModel
from aspire_ray.spec.draft_policy import DraftPolicy
from aspire_ray.worker.async_runs import AsyncTrack

MODES = "ar,magicdec,specattn,aspire_fixed,aspire_fsm,aspire"
FIXED = ("magicdec", "specattn", "aspire_fixed")  # the modes a fixed gamma applies to
GAMMAS = "1,2,3,4,6,8,12"


@dataclass(frozen=True)
class StepCosts:
    b_model: float  # s per step (worker)
    b_tok: float  # s per query token
    b_kv: float  # s per KV token read (KVReads)
    chain_b_model: float | None = None  # b_model of a draft step inside a chain (None: b_model)
    host_per_plan: float = 0.0  # s per plan outside the worker (driver, benchmark loop)
    source: str = ""
    # s more for an asynchronous run's step that holds verify rows and draft rows than the
    # linear terms say (docs/benchmarks.md §8.28); pure steps cost b_model - b_mixed where the
    # terms were fitted to such mixed steps (``with_mixed_step``)
    b_mixed: float = 0.0

    def worker_seconds(self, n_tokens: float, kv_tokens: float, chained: bool = False) -> float:
        b0 = self.chain_b_model if chained and self.chain_b_model is not None else self.b_model
        return b0 + self.b_tok * n_tokens + self.b_kv * kv_tokens


def with_mixed_step(costs: StepCosts, seconds: float, fitted_on_mixed: bool) -> StepCosts:
    """``costs`` with a mixed-step term of ``seconds``; where they were fitted to an
    asynchronous run's steps (nearly all mixed), their per-step terms lose it (a pure step is
    that much cheaper), so that a mixed step costs what it was measured to."""
    if not seconds:
        return costs
    drop = seconds if fitted_on_mixed else 0.0
    chain = None if costs.chain_b_model is None else costs.chain_b_model - drop
    return replace(costs, b_model=costs.b_model - drop, chain_b_model=chain, b_mixed=seconds)


def mixed_steps(rows: list[RowPlan]) -> int:
    """Steps of an asynchronous run (``RowPlan.async_kinds``) where some rows verify and
    others draft."""
    kinds = [row.async_kinds() for row in rows]
    return sum(any(k[s] >= 0 for k in kinds) and any(k[s] < 0 for k in kinds)
               for s in range(rows[0].num_steps))  # fmt: skip


class TraceExecutor(Executor):
    """A worker that answers from traces: a draft at output position o is the target's token
    when the trace accepts a draft there (else another token); a verify row accepts its drafts
    up to the first that differs from the target and commits the target's next token."""

    def __init__(self, cfg, meta: dict, prompt_lens: list[int], tokens: list[list[int]],
                 bits: list[str], costs: StepCosts, num_pages: int | None = None) -> None:
        self.cfg, self.meta, self.costs = cfg, meta, costs
        self.prompt_lens, self.tokens, self.bits = prompt_lens, tokens, bits
        self.policy = DraftPolicy(cfg.spec, None, cfg.cache.page_size, meta["num_layers"],
                                  meta.get("query_tile_tokens"))
        longest = max(p + len(t) for p, t in zip(prompt_lens, tokens, strict=True))
        self.max_len = longest + cfg.spec.d_max + 2
        page = cfg.cache.page_size
        self.num_pages = num_pages or sum(-(-(p + len(t) + cfg.spec.d_max + 2) // page) + 1
                                          for p, t in zip(prompt_lens, tokens, strict=True))
        self.worker_s = 0.0  # simulated worker time
        self.host_s = 0.0  # simulated driver time
        # the next asynchronous run's first steps, started early as the worker's graphs do
        # (``async_runs._start_next``): (each row's promised draft length, the run's steps,
        # the steps started, their seconds a step); None: nothing started
        self.started: tuple[dict[str, int], int, int, float] | None = None
        self.early_steps_dropped = 0

    def describe(self) -> ShardInfo:
        return ShardInfo(num_pages=self.num_pages, num_layers=self.meta["num_layers"],
                         vocab_size=self.meta.get("vocab_size", 1 << 20),
                         max_position_embeddings=self.max_len, eos_token_ids=(),
                         refresh_layer=self.meta["num_layers"] - 2, device_name="simulated",
                         query_tile_tokens=self.meta.get("query_tile_tokens"))

    def _draft(self, i: int, o: int) -> int:
        if o >= len(self.tokens[i]):  # a later round of a plan, past the request's end
            return -1
        t = self.tokens[i][o]
        return t if self.bits and self.bits[i][o] == "1" else t + 1  # any other token

    def _verify(self, i: int, row: RowPlan) -> RowResult:
        # the verify row's input x_n is at start_pos: its first draft predicts start_pos + 1
        o = row.start_pos + 1 - self.prompt_lens[i]
        if row.num_steps > 1:  # an ar decode chain: the target's next num_steps tokens
            return RowResult(row.req_id, row.kind, self.tokens[i][o : o + row.num_steps])
        target = self.tokens[i][o : o + row.num_drafts + 1]
        target += [-2] * (row.num_drafts + 1 - len(target))  # past the end: the engine stops
        drafts = row.token_ids[1:]
        a = next((j for j, d in enumerate(drafts) if d != target[j]), len(drafts))
        return RowResult(row.req_id, row.kind, target[: a + 1], a)

    def _async(self, i: int, row: RowPlan) -> RowResult:
        """An asynchronous run, step by step as the worker tracks it: a draft step's token
        from the trace, a verification's target tokens."""
        track, p = AsyncTrack(row), self.prompt_lens[i]
        for step, d in enumerate(track.kinds):
            if d < 0:  # the draft predicts the position after the last token known
                track.take(step, [self._draft(i, track.x_pos + len(track.known) - p)])
                continue
            o = track.x_pos + 1 - p
            target = self.tokens[i][o : o + d + 1]
            track.take(step, target + [-2] * (d + 1 - len(target)))
        return track.result()

    def _dropped(self, plan: StepPlan) -> float:
        """Seconds of the early-started steps this plan does not continue (the worker replays
        them, then drops them: ``Started.mismatch``), taking them off the worker's hands."""
        started, self.started = self.started, None
        if started is None:
            return 0.0
        gammas, steps, head, step_s = started
        if plan.rows and all(getattr(r, "async_gamma", None) is not None
                             and gammas.get(r.req_id) == r.async_gamma and r.num_steps == steps
                             for r in plan.rows):  # fmt: skip
            return 0.0
        self.early_steps_dropped += head
        return head * step_s

    def _start_next(self, rows: list[RowPlan], step_s: float) -> None:
        """The worker starts the next run's first steps with the rows' promised draft lengths
        (``RowPlan.next_async_gamma``) where every row has one."""
        steps = rows[0].next_async_steps or rows[0].num_steps
        head = min(self.cfg.spec.overlap_steps, steps)
        if head and all(r.next_async_gamma is not None for r in rows):
            self.started = ({r.req_id: r.next_async_gamma for r in rows}, steps, head,
                            step_s)  # fmt: skip

    def execute(self, plan: StepPlan) -> StepOutput:
        dropped = self._dropped(plan)
        results, verify_after = [], []
        for row in plan.rows:
            i = int(row.req_id.rsplit("-", 1)[1])
            # output index of the token this row's (first) query predicts
            o = row.context_len - self.prompt_lens[i]
            if row.kind == RowKind.PREFILL:  # (a recomputed request's prompt holds outputs)
                results.append(RowResult(row.req_id, row.kind,
                                         [self.tokens[i][o]] if row.sample else []))
            elif row.kind == RowKind.VERIFY:
                results.append(self._verify(i, row))
            elif getattr(row, "async_gamma", None) is not None:
                results.append(self._async(i, row))
            elif getattr(row, "verify_after", None) is None:
                results.append(RowResult(row.req_id, row.kind,
                                         [self._draft(i, o + s) for s in range(row.num_steps)]))
            else:  # chains that end their rounds with a verification, in the same plan
                rounds = []
                for r in range(row.num_rounds):
                    o = row.context_len - self.prompt_lens[i]
                    drafts = [self._draft(i, o + s) for s in range(row.num_steps)]
                    vrow = row.verify_row(drafts)
                    verify_after.append((r, vrow))
                    rounds.append(RowResult(row.req_id, row.kind, drafts,
                                            verified=self._verify(i, vrow)))
                    if row.num_rounds > 1:
                        row = row.next_round(rounds[-1].verified.tokens)
                rounds[0].rounds = rounds[1:]
                results.append(rounds[0])
        if plan.rows and getattr(plan.rows[0], "async_gamma", None) is not None:
            # an asynchronous run: its mean step (at the run's first context), steps times,
            # and the mixed-step term for each step that holds verify and draft rows
            step_s = self.costs.worker_seconds(*self.policy.run_features(plan.rows),
                                               chained=True)  # fmt: skip
            seconds = plan.rows[0].num_steps * step_s + dropped
            if self.costs.b_mixed:
                seconds += self.costs.b_mixed * mixed_steps(plan.rows)
            self._start_next(plan.rows, step_s)
            self.worker_s += seconds
            self.host_s += self.costs.host_per_plan
            return StepOutput(plan.step_id, results, StepTimings(forward=seconds, total=seconds))
        # each round: its chain's steps (priced at the plan's first context), its verification
        steps = max(r.num_steps for r in plan.rows)
        rounds = max(r.num_rounds for r in plan.rows)
        seconds = dropped + rounds * steps * self.costs.worker_seconds(
            *self.policy.step_features(plan.rows), chained=steps > 1)  # fmt: skip
        for r in range(rounds if verify_after else 0):
            vrows = [v for at, v in verify_after if at == r]
            seconds += self.costs.worker_seconds(*self.policy.step_features(vrows))
        self.worker_s += seconds
        self.host_s += self.costs.host_per_plan
        return StepOutput(plan.step_id, results, StepTimings(forward=seconds, total=seconds))


def oracle_targets(policy: DraftPolicy, bits: list[str]):
    """``DraftPolicy.targets`` of a policy that knows the trace: each request drafts exactly
    up to its next rejected position (its run of accepted bits from its next output position),
    within its cap, max_drafts and its verification's query tile (a longer run verifies in
    pieces: one more query there reads the KV again). No draft is wasted and none is missed:
    about what per-request draft lengths could buy at best under the same step costs
    (``simulate(oracle=True)``)."""
    tile = policy.kv_reads.query_tile
    most = policy.cfg.max_drafts if tile is None else min(policy.cfg.max_drafts, tile - 1)

    def targets(reqs, caps):
        out = []
        for req, cap in zip(reqs, caps, strict=True):
            b = bits[int(req.req_id.rsplit("-", 1)[1])]
            o, limit = len(req.output_token_ids), min(cap, most)
            run = 0
            while run < limit and o + run < len(b) and b[o + run] == "1":
                run += 1
            out.append(run)
        return out

    return targets


def simulate(traces: Traces, mode: str, costs: StepCosts, gamma: int | None = None,
             window: str = "steady", num_pages: int | None = None,
             max_batched_tokens: int = 16384, batch: int | None = None,
             prompt_len: int | None = None, num_layers: int | None = None,
             num_tokens: int | None = None, oracle: bool = False, **spec) -> dict:  # fmt: skip
    """One mode (bench_decode's MODE or MODE/nochain) at one gamma -> bench_decode's summary
    with simulated tokens/s. oracle: a per-request mode's draft lengths from the trace itself
    (``oracle_targets``), its mode reported as "MODE+oracle".

    Projections (the acceptance of the recorded text, the shape of another deployment):
    ``batch`` requests taken from the recorded ones in turn, every prompt ``prompt_len`` tokens
    long, a model of ``num_layers`` layers (the cost source's; it weighs the refresh read),
    generations of ``num_tokens`` tokens (``repeated``: each request's recording again and
    again, its acceptance and its runs of accepted drafts as recorded)."""
    spec_mode, options = mode_options(mode)
    tokens, bits, info = traces.replay(mode)
    if num_tokens:
        tokens = [repeated(t, num_tokens) for t in tokens]
        bits = [repeated(b, num_tokens) for b in bits]
    prompt_lens = [prompt_len or r.prompt_len for r in traces.requests]
    if batch:
        pick = [i % len(tokens) for i in range(batch)]
        tokens, prompt_lens = [tokens[i] for i in pick], [prompt_lens[i] for i in pick]
        bits = [bits[i] for i in pick] if bits else bits
    meta = dict(traces.meta, num_layers=num_layers or traces.meta["num_layers"])
    if gamma is not None:
        spec["gamma"] = gamma
    cfg = build_engine_config("dummy", load_format="dummy", spec_mode=spec_mode, calibrate="off",
                              page_size=meta["page_size"], max_num_seqs=len(tokens),
                              max_num_batched_tokens=max_batched_tokens,
                              **{**meta["spec"], **options, **spec})  # fmt: skip
    ex = TraceExecutor(cfg, meta, prompt_lens, tokens, bits, costs, num_pages)
    engine = LLMEngine(cfg, executor=ex)
    engine.cost_model.set_prior(CostCoefficients(costs.b_model, costs.b_tok, costs.b_kv))
    if oracle:  # each step's lengths from the trace: plans of one step (a run keeps its lengths)
        if cfg.spec.mode_spec.gamma_rule != "cost_model" or not bits or cfg.spec.async_steps > 1:
            raise SystemExit(f"oracle: a per-request mode of one-step plans (MODE/s1) with "
                             f"acceptance bits, not {mode}")  # fmt: skip
        engine.policy.targets = oracle_targets(engine.policy, bits)
    _warm_up(engine, prompt_lens, tokens)
    ids, finished = _prefill(engine, prompt_lens, [len(t) for t in tokens])
    before = {k: dict(v) if isinstance(v, dict) else v for k, v in engine.stats().items()}
    clock0 = (ex.worker_s, ex.host_s, ex.early_steps_dropped)
    state0 = window_state(engine, finished)
    first = len(finished)
    end = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if end is None and window == "steady" and len(finished) > first:
            end = (ex.worker_s, ex.host_s, window_state(engine, finished), engine.stats(),
                   ex.early_steps_dropped)  # fmt: skip
    if end is None:
        end = (ex.worker_s, ex.host_s, window_state(engine, finished), engine.stats(),
               ex.early_steps_dropped)  # fmt: skip
    worker, host, state, after, dropped = end
    breakdown = _diff(after, before)
    # simulated time only (the driver's own timings of this run are the simulator's)
    breakdown["timings"] = {"total": worker - clock0[0], "host": host - clock0[1]}
    # what the window's tokens came from, as bench_decode reports it for a measured window
    breakdown["window"] = window_delta(state0, state)
    run = {"outs": [finished[r] for r in ids], "seconds": worker + host - clock0[0] - clock0[1],
           "tokens": breakdown["window"]["tokens"], "breakdown": breakdown}
    s = summarize(f"{mode}+oracle" if oracle else mode, run, None)
    s.pop("token_ids")
    s.update(gamma=cfg.spec.gamma if spec_mode in FIXED else None, trace=info,
             batch=len(tokens), probes=engine.stats()["probes"],
             early_steps_dropped=dropped - clock0[2])
    return s


def repeated(seq, n: int):
    """``seq`` (a request's output tokens or acceptance bits) continued to length n by its own
    positions 1.. again and again (position 0 comes from the prompt: never drafted)."""
    if len(seq) >= n or len(seq) < 2:
        return seq[:n]
    tail = seq[1:]
    return (seq + tail * (-(-(n - len(seq)) // len(tail))))[:n]


def _warm_up(engine: LLMEngine, prompt_lens: list[int], tokens: list[list[int]]) -> None:
    """bench_decode's warm-up on the same engine: its first requests' first WARMUP_TOKENS
    tokens (request ids "warm-i": the trace's request i), run to their end."""
    n = min(WARMUP_REQUESTS, len(prompt_lens))
    _prefill_named(engine, prompt_lens[:n], [min(WARMUP_TOKENS, len(t)) for t in tokens[:n]],
                   "warm")  # fmt: skip
    while engine.has_unfinished():
        engine.step()


def _prefill(engine: LLMEngine, prompt_lens: list[int],
             max_tokens: list[int]) -> tuple[list[str], dict]:  # fmt: skip
    """bench_decode.prefill_batch with each request's own max_tokens (its recorded length)."""
    return _prefill_named(engine, prompt_lens, max_tokens, "sim")


def _prefill_named(engine: LLMEngine, prompt_lens: list[int], max_tokens: list[int],
                   name: str) -> tuple[list[str], dict]:  # fmt: skip
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    return prefill_batch(engine, [[0] * n for n in prompt_lens], params, name)


# ---- step costs from what was measured ----------------------------------------------------------
def load_costs(path: str, mode: str, meta: dict) -> StepCosts:
    """Step costs for simulating ``mode`` from a JSON file (module docstring); for files that
    hold several modes, ``mode``'s own measurement."""
    data = read_json(path)
    if "b_model" in data:  # coefficients, or an engine's stats()["cost_model"]
        return StepCosts(data["b_model"], data["b_tok"], data["b_kv"],
                         data.get("chain_b_model"), data.get("host_per_plan", 0.0), path)
    if "cost_model" in data:  # an engine's stats(): no decode window known
        return costs_from_breakdown(data, None, path)
    if "modes" in data:  # a trace file: its recorded runs
        results = [dict(r, mode=m) for m, r in data["modes"].items()]
    else:
        results = data.get("results", [])
    if results and "kinds" in results[0]:
        return costs_from_floor(data, meta, path, mode)
    match = [r for r in results if r.get("mode") == mode and "breakdown" in r]
    if not match:
        raise SystemExit(f"{path}: no measured run of mode {mode!r} "
                         f"(has {sorted({r.get('mode') for r in results})})")
    r = match[0]
    if r["breakdown"].get("step_kinds", {}).get("async") and r["breakdown"].get("gpu_clock"):
        return costs_from_clock(r, meta, f"{path}:{mode} (GPU clock)")
    status = r["breakdown"]["cost_model"].get("status", "fit")
    if status.startswith("prior"):  # nothing fitted: priced from its measured steps
        return costs_from_steps(r, results, meta, f"{path}:{mode}")
    costs = costs_from_breakdown(r["breakdown"], r.get("decode_seconds"), f"{path}:{mode}")
    return _with_chain_cost(costs, r, meta)


def costs_from_breakdown(b: dict, decode_seconds: float | None, source: str) -> StepCosts:
    """The cost model's fit; host time per plan = the decode window not spent in the worker
    (or the driver's schedule + commit + executor overhead, without a window)."""
    cm, t, plans = b["cost_model"], b["timings"], max(b["steps"], 1)
    status = cm.get("status", "fit")
    # "offset": the prior's slopes and a per-step term fitted to the served steps (the engine's
    # own pricing of them); a prior in force means nothing was measured
    if status != "fit" and not status.startswith("offset"):
        raise SystemExit(f"{source}: its cost model was not fitted ({status})")
    if decode_seconds is not None:
        host = (decode_seconds - t.get("total", 0.0)) / plans
    else:
        host = (t.get("schedule", 0.0) + t.get("commit", 0.0)
                + t.get("execute", 0.0) - t.get("total", 0.0)) / plans
    return StepCosts(cm["b_model"], cm["b_tok"], cm["b_kv"], None, max(host, 0.0), source)


def costs_from_clock(r: dict, meta: dict, source: str) -> StepCosts:
    """An asynchronous run timed by the graph clock (``bench_decode --diagnose``): its slopes
    b_tok and b_kv from the engine's cost model, and a per-step term that makes a step at the
    window's mean (every row of the batch at the mean context, drafting or verifying in
    proportion to its mean draft length) cost the mean GPU time of a replay; host time per
    plan: the GPU's idle time in the window per plan (what the host cost the GPU, not the
    host's own time, much of which the runs started early hide). The engine's online fit of
    such runs is an offset on the prior's slopes with r² < 0 (§8.36), 8% under the replays.
    Where the clock timed the replays with verify rows apart (``by_kind`` "async_verify"
    beside "async", since session 41), the per-step term prices the draft-only replays and
    ``b_mixed`` what the others cost past the linear terms (``_clock_mixed``)."""
    b, clock = r["breakdown"], r["breakdown"]["gpu_clock"]
    coef, batch = b["cost_model"], int(r.get("batch", 1))
    policy, ctx = _policy(r["mode"], meta), _window_context(r, meta)
    g = max(1, round(r.get("gamma_mean") or 1))
    host = clock["gap_ms"] / 1e3 / max(b["steps"], 1)
    kinds = clock.get("by_kind", {})
    if kinds.get("async", {}).get("replays") and kinds.get("async_verify", {}).get("replays"):
        per_step, mixed = _clock_mixed(kinds, coef, policy, ctx, g, batch)
        return StepCosts(per_step, coef["b_tok"], coef["b_kv"], per_step, host, source, mixed)
    # a round of each row: g draft steps, then a verification of g + 1 queries
    draft = _rows_features(policy, RowKind.DRAFT, ctx, 0, batch)
    verify = _rows_features(policy, RowKind.VERIFY, ctx, g, batch)
    tokens, kv_tokens = ((g * d + v) / (g + 1) for d, v in zip(draft, verify, strict=True))
    step = clock["busy_ms"] / 1e3 / max(clock["replays"], 1)
    per_step = max(0.0, step - coef["b_tok"] * tokens - coef["b_kv"] * kv_tokens)
    return StepCosts(per_step, coef["b_tok"], coef["b_kv"], per_step, host, source)


def _clock_mixed(kinds: dict, coef: dict, policy: DraftPolicy, ctx: int, g: int,
                 batch: int) -> tuple[float, float]:  # fmt: skip
    """(per-step term, b_mixed) from an asynchronous run's replays by kind: a draft-only replay
    (every row drafting) costs the per-step term and the linear terms; a replay with verify
    rows in it holds the window's verifications (each row verifies once in g + 1 steps) shared
    evenly, the rest of its rows drafting, and costs b_mixed more than the linear terms say."""
    slope = lambda f: coef["b_tok"] * f[0] + coef["b_kv"] * f[1]  # noqa: E731
    draft_row = _rows_features(policy, RowKind.DRAFT, ctx, 0, 1)
    verify_row = _rows_features(policy, RowKind.VERIFY, ctx, g, 1)
    d, m = kinds["async"], kinds["async_verify"]
    per_step = max(0.0, d["mean_ms"] / 1e3 - batch * slope(draft_row))
    v = min(batch, batch * (d["replays"] + m["replays"]) / (g + 1) / m["replays"])
    mixed = v * slope(verify_row) + (batch - v) * slope(draft_row)
    return per_step, max(0.0, m["mean_ms"] / 1e3 - per_step - mixed)


def _window_context(r: dict, meta: dict) -> int:
    """A run's mean context in its decode window: the prompt and half its new tokens."""
    batch = int(r.get("batch", 1))
    prompt = int(r["context"]) if str(r.get("context")).isdigit() else meta["mean_prompt_len"]
    return prompt + r["tokens"] // (2 * batch)


def _rows_features(policy: DraftPolicy, kind: RowKind, ctx: int, drafts: int,
                   batch: int) -> tuple[int, float]:  # fmt: skip
    """``step_features`` of a step of ``batch`` like rows: drafts (one query each) or
    verifications of ``drafts`` drafts (``ar``'s steps: none)."""
    row = RowPlan("x", kind, [0] * (1 + drafts), ctx - 1, 0, [], num_drafts=drafts)
    return policy.step_features([row] * batch)


def costs_from_steps(r: dict, results: list[dict], meta: dict, source: str) -> StepCosts:
    """A run whose cost model kept its prior (``ar``, whose steps have too few shapes, and
    the round modes, whose plans hold a chain and its verification: not separable), priced
    from its own measured steps: the prior's b_tok; b_kv from the same file's `ar` steps past
    the prior's b_model (every mode reads its KV at the same speed; the prior's b_kv is the
    copy bandwidth's bound, which a decode step beats by ~7% on an H200); and one per-step
    term for every forward of the mode, draft or verify, chained or not, solved so that the
    model's mean step (`ar`) or round (a fixed gamma's g draft steps and its verification, at
    the window's mean context) costs what was measured. A forward's fixed cost (weights,
    launches) does not depend on its rows' kinds, so the same term prices `aspire`'s mixed
    steps when this mode's costs price it (``--cost-mode``)."""
    b = r["breakdown"]
    prior, kinds, seconds = b["cost_model"]["prior"], b["step_kinds"], b["step_seconds"]
    b_model, b_tok, b_kv = prior["b_model"], prior["b_tok"], prior["b_kv"]
    batch = int(r.get("batch", 1))
    ar = next((x for x in results if x.get("mode") == "ar" and "breakdown" in x
               and x["breakdown"]["step_kinds"].get("verify")), None)  # fmt: skip
    if ar is not None:
        ak = ar["breakdown"]
        step = ak["step_seconds"]["verify"] / ak["step_kinds"]["verify"]
        n, kv = _rows_features(_policy("ar", meta), RowKind.VERIFY, _window_context(ar, meta),
                               0, int(ar.get("batch", 1)))  # fmt: skip
        if step - b_model - b_tok * n > 0 and kv > 0:
            b_kv = (step - b_model - b_tok * n) / kv
    spec_mode = r["mode"].partition("/")[0]
    policy, ctx = _policy(r["mode"], meta), _window_context(r, meta)
    if kinds.get("round"):  # g chained draft steps and a verification of g drafts a round
        g = int(r.get("gamma") or mode_options(r["mode"])[1].get("gamma")
                or SpecConfig(mode=spec_mode).gamma)  # fmt: skip
        n_d, kv_d = _rows_features(policy, RowKind.DRAFT, ctx, 0, batch)
        n_v, kv_v = _rows_features(policy, RowKind.VERIFY, ctx, g, batch)
        slopes = g * (b_tok * n_d + b_kv * kv_d) + b_tok * n_v + b_kv * kv_v
        per_step = (seconds["round"] / kinds["round"] - slopes) / (g + 1)
    elif kinds.get("verify"):  # decode chains (or single steps) of `ar`
        n, kv = _rows_features(policy, RowKind.VERIFY, ctx, 0, batch)
        per_step = seconds["verify"] / kinds["verify"] - b_tok * n - b_kv * kv
    else:
        raise SystemExit(f"{source}: its cost model was not fitted ({b['cost_model']['status']}) "
                         f"and it ran no round or `ar` step to price from")
    plans = max(b["steps"], 1)
    host = (r["decode_seconds"] - b["timings"].get("total", 0.0)) / plans \
        if r.get("decode_seconds") is not None else 0.0  # fmt: skip
    per_step = max(per_step, 0.0)
    return StepCosts(per_step, b_tok, b_kv, per_step, max(host, 0.0), f"{source} (measured steps)")


def _with_chain_cost(costs: StepCosts, r: dict, meta: dict) -> StepCosts:
    """A run with draft chains (fewer plans than steps): chain_b_model makes the model's mean
    draft step equal the measured one (a full batch at the window's mean context)."""
    b = r["breakdown"]
    drafts = b["step_kinds"].get("draft", 0)
    # (a "round" plan, a chain and its verification, holds steps of both kinds: not separable)
    if not drafts or b["steps"] >= sum(b["step_kinds"].values()) or "round" in b["step_kinds"]:
        return costs
    measured = b["step_seconds"]["draft"] / drafts
    policy = _policy(r["mode"], meta)
    n, kv = _rows_features(policy, RowKind.DRAFT, _window_context(r, meta), 0,
                           int(r.get("batch", 1)))
    chain_b_model = max(0.0, measured - costs.b_tok * n - costs.b_kv * kv)
    return StepCosts(costs.b_model, costs.b_tok, costs.b_kv, chain_b_model,
                     costs.host_per_plan, costs.source)


def _spec_of(mode: str, **fields) -> SpecConfig:
    """A bench mode's (MODE/VARIANT) SpecConfig as far as pricing needs it: its row of MODES
    and the ``norefresh`` / ``refresh`` variant's ``draft_refresh``, with ``fields``."""
    spec_mode, options = mode_options(mode)
    return SpecConfig(mode=spec_mode, draft_refresh=options.get("draft_refresh"), **fields)


def _refreshes(mode: str) -> bool:
    """Whether a bench mode runs the refresh layer while drafting."""
    return _spec_of(mode).refresh_while_drafting


def costs_from_floor(data: dict, meta: dict, source: str, mode: str) -> StepCosts:
    """bench_floor's steps (homogeneous batches at one context) -> the engine's CostModel fit
    over the engine's features; chained draft steps set chain_b_model; host = wall - worker.

    Fitted to the steps of the modes that draft like ``mode`` (refreshing or not) and `ar`'s:
    a refreshing draft step costs more than its bytes (its page scoring and top-k), which one
    b_kv shared with non-refreshing drafts cannot follow (r² 0.69 on the H200's 32k floor)."""
    args = data["args"]
    layers = DUMMY_SHAPES.get(args.get("dummy_shapes") or "", {}).get("num_hidden_layers")
    meta = dict(meta, num_layers=layers or meta["num_layers"])
    refresh = _refreshes(mode)
    model = CostModel(min_samples=3, min_shapes=3)
    chained, host = [], []
    for r in data["results"]:
        spec_mode = r["mode"].partition("/")[0]
        if spec_mode != "ar" and _refreshes(r["mode"]) != refresh:
            continue
        policy = _policy(r["mode"], meta)
        for s in r["steps"]:
            kind = "draft" if s["kind"] == "draft" else "verify"
            d = s["tokens"] // s["rows"] - 1
            row = RowPlan("x", RowKind[kind.upper()], [0] * (1 + max(d, 0)), args["context"], 0,
                          [], num_drafts=max(d, 0))
            n, kv = policy.step_features([row] * s["rows"])
            if s.get("chain", 1) > 1:
                chained.append((n, kv, s["worker_s"]["total"]))
                continue
            model.add_sample(n, kv, s["worker_s"]["total"])
            host.append(s["wall_s"] - s["worker_s"]["total"])
    coef = model.fit()
    if not model.fitted:
        raise SystemExit(f"{source}: the step times do not fit three terms ({model.status})")
    chain = None
    if chained:
        chain = max(0.0, statistics.mean(t - coef.b_tok * n - coef.b_kv * kv
                                         for n, kv, t in chained))
    return StepCosts(coef.b_model, coef.b_tok, coef.b_kv, chain,
                     statistics.median(host) if host else 0.0, source)


def _policy(mode: str, meta: dict) -> DraftPolicy:
    """The draft policy whose features price a mode's steps (MODE or MODE/VARIANT: a
    ``norefresh`` draft row reads no full KV at the refresh layer)."""
    return DraftPolicy(_spec_of(mode, **meta["spec"]), None, meta["page_size"], meta["num_layers"],
                       meta.get("query_tile_tokens"))


# ---- measured runs to compare with ----------------------------------------------------------
def measured_runs(path: str) -> dict[tuple[str, int | None], dict]:
    """(mode, gamma) -> a measured bench_decode result (a bench JSON or a trace file)."""
    data = read_json(path)
    default = (data.get("args") or {}).get("gamma") or SpecConfig().gamma
    if "modes" in data:
        items = list(data["modes"].items())
    else:
        items = [(r["mode"], r) for r in data["results"]]
    out = {}
    for m, r in items:
        spec_mode = m.partition("/")[0]
        g = r.get("gamma", mode_options(m)[1].get("gamma", default)) \
            if spec_mode in FIXED else None  # fmt: skip
        out[(m, g)] = r
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--traces", required=True, help="a trace file (bench_decode --record-traces)")
    p.add_argument("--costs", required=True, help="step costs (JSON; see above)")
    p.add_argument("--cost-mode", default="own",
                   help="whose measurement prices every mode, in files of several modes: "
                        "'own' (each mode its own, else --cost-fallback) or a mode name")
    p.add_argument("--cost-fallback", default="ar", help="for modes the cost file lacks")
    p.add_argument("--modes", default=MODES)
    p.add_argument("--gammas", default=GAMMAS, help="fixed gammas of magicdec/specattn/"
                   "aspire_fixed ('' : the recorded/default gamma only)")
    p.add_argument("--window", choices=("steady", "drain"), default="steady")
    p.add_argument("--num-pages", type=int, default=None,
                   help="KV pool size in pages (default: room for every request)")
    p.add_argument("--max-batched-tokens", type=int, default=16384)
    p.add_argument("--batch", type=int, default=None,
                   help="projection: this many requests, the recorded ones in turn")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="projection: every prompt this long (acceptance as recorded)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="projection: the cost source's model depth (default: the trace's)")
    p.add_argument("--num-tokens", type=int, default=None,
                   help="projection: generations this long, each request's recording repeated")
    p.add_argument("--mixed-step-ms", type=float, default=0.0,
                   help="an asynchronous step holding verify and draft rows costs this much "
                        "more than the linear terms (docs/benchmarks.md §8.28: ~0.29 on the "
                        "H200 at 32k); costs fitted to `aspire`'s steps lose it per step")
    p.add_argument("--measured", default=None,
                   help="a bench_decode JSON (or trace file) of the same requests: error %%")
    p.add_argument("--oracle", action="store_true",
                   help="also each per-request mode of one-step plans (MODE/s1...) with draft "
                        "lengths that know the trace (oracle_targets): about the most its "
                        "draft lengths could buy")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    traces = Traces.load(args.traces)
    mean_prompt = statistics.mean(r.prompt_len for r in traces.requests)
    meta = dict(traces.meta, num_layers=args.num_layers or traces.meta["num_layers"],
                mean_prompt_len=args.prompt_len or round(mean_prompt))
    gammas = [int(g) for g in args.gammas.split(",") if g]
    cost_cache: dict[str, StepCosts] = {}

    def costs_for(mode: str) -> StepCosts:
        key = mode if args.cost_mode == "own" else args.cost_mode
        if key not in cost_cache:
            source = key
            try:
                costs = load_costs(args.costs, key, meta)
            except SystemExit as e:
                if key == args.cost_fallback or args.cost_mode != "own":
                    raise
                print(f"{mode}: priced by {args.cost_fallback}'s costs ({e})")
                source = args.cost_fallback
                costs = load_costs(args.costs, source, meta)
            spec = SpecConfig(mode=source.partition("/")[0])
            asynchronous = spec.speculative and not spec.synchronized
            cost_cache[key] = with_mixed_step(costs, args.mixed_step_ms / 1e3, asynchronous)
        return cost_cache[key]

    measured = measured_runs(args.measured) if args.measured else {}
    runs = []
    for mode in args.modes.split(","):
        spec_mode = mode.partition("/")[0]
        policy = policy_of(mode)
        if policy is not None and not traces.source_modes(policy):
            print(f"{mode}: skipped, no recorded trace of its page policy {policy!r}")
            continue
        # the sweep, the recorded gamma, and the measured ones
        extra = {traces.modes.get(mode, {}).get("gamma") or SpecConfig().gamma}
        extra |= {g for m, g in measured if m == mode}
        sweep = sorted(set(gammas) | extra) if spec_mode in FIXED else [None]
        if "gamma" in mode_options(mode)[1]:  # MODE/gN: that gamma alone
            sweep = [mode_options(mode)[1]["gamma"]]
        # the oracle decides every step: plans of one step (asynchronous runs keep a length)
        oracles = [False, True] if args.oracle and SpecConfig(mode=spec_mode).mode_spec \
            .gamma_rule == "cost_model" and mode_options(mode)[1].get("async_steps") == 1 \
            else [False]  # fmt: skip
        for g in sweep:
            for oracle in oracles:
                runs.append(simulate(traces, mode, costs_for(mode), g, args.window,
                                     args.num_pages, args.max_batched_tokens, args.batch,
                                     args.prompt_len, args.num_layers, args.num_tokens,
                                     oracle=oracle))  # fmt: skip
                runs[-1]["costs"] = asdict(costs_for(mode))
    ar = next((r["tokens_per_s"] for r in runs if r["mode"] == "ar"), None)
    print(f"{'mode':>20} {'gamma':>5} {'tok/s':>10} {'x ar':>6} {'L':>5} {'accept':>6} "
          f"{'mean g':>6} {'measured':>10} {'error':>7}")
    for r in runs:
        r["speedup_vs_ar"] = r["tokens_per_s"] / ar if ar else None
        m = measured.get((r["mode"], r["gamma"]))
        if m is not None:
            r["measured_tokens_per_s"] = m["tokens_per_s"]
            r["error_pct"] = 100 * (r["tokens_per_s"] / m["tokens_per_s"] - 1)
            r["measured_mean_accepted_length"] = m.get("mean_accepted_length")
        acc = r["acceptance_rate"]
        print(f"{r['mode']:>20} {r['gamma'] if r['gamma'] is not None else '-':>5} "
              f"{r['tokens_per_s']:10.1f} {r['speedup_vs_ar'] or math.nan:6.2f} "
              f"{r['mean_accepted_length']:5.2f} {acc if acc is not None else math.nan:6.3f} "
              f"{r['gamma_mean']:6.2f} {r.get('measured_tokens_per_s', math.nan):10.1f} "
              f"{r.get('error_pct', math.nan):+6.1f}%")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "meta": meta, "results": runs}, f, indent=1)


if __name__ == "__main__":
    main()
