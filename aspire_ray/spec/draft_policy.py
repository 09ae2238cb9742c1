"""When each request drafts and when it verifies (DESIGN.md §1.5, §1.6).

Every step, each decoding request gets one action: DRAFT (one more sparse draft token),
VERIFY (verify its d pending drafts; d = 0 is a plain autoregressive step) or IDLE (only in
synchronized modes, while it waits for the rest of the batch to finish drafting).

gamma = 0 is never absorbing (``aspire``): a verification with d = 0 teaches neither alpha nor
the cost model anything about drafting, so a request whose target stayed 0 for ``probe_every``
verifications drafts one probe token (docs/speculation.md says why a probe, not an optimistic
alpha).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import TYPE_CHECKING

import numpy as np

from aspire_ray.config import SpecConfig
from aspire_ray.plan import RowKind, RowPlan, async_kinds, held_after

from .acceptance import best_gamma, update_alpha, update_pooled
from .cost_model import CostModel, KVReads

if TYPE_CHECKING:  # spec never imports the engine at run time
    from aspire_ray.engine.request import Request

# The engine's recent acceptance (``DraftPolicy.prior_alpha``): each verification leaves
# PRIOR_DECAY of the earlier ones' weight (~200 verifications' memory: a few rounds of a batch of
# 64, so a change of traffic shows soon); it is a new request's prior once PRIOR_MIN_TRIED
# drafts were tried (a few verifications), capped at PRIOR_MAX (a prior of 1 would promise
# every draft accepted).
PRIOR_DECAY = 0.995
PRIOR_MIN_TRIED = 16.0
PRIOR_MAX = 0.98


def aligned_gamma(gamma: int, held: int, step: int, quantum: int, cap: int) -> int:
    """The draft length nearest ``gamma`` (ties: the longer) that makes a row holding ``held``
    drafts at decode step ``step`` verify on a slot (a step s with s % quantum == quantum - 1):
    it verifies at step + g - held, so g = held + the steps to a slot + a multiple of quantum,
    within [max(held, 1), cap]. A row that verified on a slot and drafts g = k * quantum - 1
    stays on the slots. gamma 0 and rows with no slot within cap keep gamma (clamped to cap)."""
    if gamma == 0:
        return 0
    first = held + (quantum - 1 - step) % quantum  # verifies on the first slot >= step
    if first < 1:
        first += quantum
    reachable = range(first, cap + 1, quantum)
    if not reachable:
        return min(gamma, cap)
    return min(reachable, key=lambda g: (abs(g - gamma), -g))


def run_gamma(gamma: int, held: int, step: int, quantum: int, cap: int, steps: int) -> int:
    """The draft length of a row through an asynchronous run of ``steps`` steps from decode
    step ``step`` (the worker keeps it for the whole run, ``async_kinds``), holding ``held``
    drafts: the one whose verifications fall off the slots the fewest times, in this run and
    in the runs after it until the row is in phase (``_to_phase``); among those the nearest
    ``gamma`` (ties: the longer). A row that holds drafts where a cycle starts cannot verify
    on its slot within one query tile (held + quantum - 1 drafts); ``aligned_gamma`` then kept
    its length and the row verified off the slots run after run, each such step a mixed one
    (docs/benchmarks.md §8.61: a third of the five-domain mix's rows, for good). Here it takes
    one or two runs of shorter rounds back into phase (a length below ``held`` verifies the
    drafts held at once, then rounds of that length). gamma 0 stays; where no length ever
    gets into phase (a cap below quantum - 1), ``aligned_gamma``."""
    if gamma == 0:
        return 0
    return _run_gamma(gamma, held, step % quantum, quantum, cap, steps)


@functools.lru_cache(maxsize=8192)
def _run_gamma(gamma: int, held: int, phase: int, quantum: int, cap: int, steps: int) -> int:
    # a few dozen distinct arguments a plan, two calls a row (this run, the one promised):
    # cached, on the host's critical path
    to_phase = _to_phase(quantum, cap)
    ends_cycle = (phase + steps) % quantum == 0
    best = None
    for g in range(1, cap + 1):  # below held: it verifies those at once, then rounds of g
        off, end = _off_slot(held, g, phase, steps, quantum)
        cost = off + (to_phase[min(end, cap)] if ends_cycle else 0)
        key = (cost, abs(g - gamma), -g)
        if cost < math.inf and (best is None or key < best[0]):
            best = (key, g)
    return best[1] if best is not None else aligned_gamma(gamma, held, phase, quantum, cap)


@functools.lru_cache(maxsize=4096)
def _off_slot(held: int, gamma: int, phase: int, steps: int, quantum: int) -> tuple[int, int]:
    """(verifications off the slots, drafts held after) of a run of ``steps`` steps from a step
    ``phase`` steps into a slot cycle (slots: phase quantum - 1)."""
    kinds = async_kinds(held, gamma, steps)
    off = sum(k >= 0 and (phase + i) % quantum != quantum - 1 for i, k in enumerate(kinds))
    return off, held_after(kinds, held)


@functools.lru_cache(maxsize=256)
def _to_phase(quantum: int, cap: int) -> tuple[float, ...]:
    """For each number of drafts held where a slot cycle starts (0..cap): the fewest
    verifications off the slots before the row is in phase, its runs one cycle each with a
    draft length of 1..cap each (inf: never). In phase: a length that verifies on the slots
    only and comes back to where it started (0 held, draft length quantum - 1). A row never
    holds more than its length after a run, so the states stop at the cap."""
    cost = [math.inf] * (cap + 1)
    for h in range(cap + 1):
        for g in range(1, cap + 1):
            if _off_slot(h, g, 0, quantum, quantum) == (0, h):
                cost[h] = 0
    for _ in range(cap + 1):  # Bellman-Ford: at most cap + 1 runs to a state in phase
        for h in range(cap + 1):
            for g in range(1, cap + 1):
                off, end = _off_slot(h, g, 0, quantum, quantum)
                if end <= cap:
                    cost[h] = min(cost[h], off + cost[end])
    return tuple(cost)


class Action(enum.Enum):
    DRAFT = "draft"
    VERIFY = "verify"
    IDLE = "idle"


class DraftPolicy:
    def __init__(self, cfg: SpecConfig, cost_model: CostModel | None, page_size: int,
                 num_layers: int, query_tile: int | None = None) -> None:  # fmt: skip
        """query_tile: query tokens of a row that share one KV read (``KVReads``); it also
        sets the verify slots where ``cfg.verify_quantum`` is None (``resolved_quantum``:
        ``self.cfg`` holds the number every reader of the policy's config sees)."""
        self.cfg = dataclasses.replace(cfg, verify_quantum=cfg.resolved_quantum(query_tile))
        self.cost_model = cost_model
        self.page_size = page_size
        self.kv_reads = KVReads(num_layers, cfg.refresh_while_drafting, query_tile)
        # verifications with drafts after >= probe_every plain ones: the probes (aspire)
        self.num_probes = 0
        # every request's drafts accepted and tried, decayed per verification: the engine's
        # recent acceptance, a new request's prior (``prior_alpha``)
        self.seen_accepted = self.seen_tried = 0.0

    def prior_alpha(self) -> float:
        """A new request's acceptance estimate before its first verification: what this
        engine's recent verifications accepted (same model, page policy and kind of traffic)
        once they tried ``PRIOR_MIN_TRIED`` drafts, else ``alpha_init``. With alpha_init
        alone every request of a batch drafted its first rounds at the prior's length (3-4
        drafts at 0.8) where the text accepted ~0.95 (docs/speculation.md)."""
        if self.seen_tried < PRIOR_MIN_TRIED:
            return self.cfg.alpha_init
        return min(self.seen_accepted / self.seen_tried, PRIOR_MAX)

    def on_admit(self, req: Request) -> None:
        req.alpha = self.prior_alpha()
        # the pooled estimate starts from one round's worth of drafts at the prior
        req.alpha_tried = float(max(1, self.cfg.gamma_init))
        req.alpha_accepted = req.alpha * req.alpha_tried
        req.fsm_gamma = self.cfg.gamma

    def sparse_tokens(self, context_len: int) -> int:
        """|S_i| in tokens for a request with this context (DESIGN.md §1.1)."""
        pages = math.ceil(context_len / self.page_size)
        k = self.cfg.sparse_budget(pages)
        return k * self.page_size if pages > k else context_len

    def sparse_tokens_of(self, context_len: np.ndarray) -> np.ndarray:
        """``sparse_tokens`` of every entry of int64 [R] contexts -> int64 [R]."""
        pages = -(-context_len // self.page_size)
        k = self.cfg.sparse_budgets(pages)
        return np.where(pages > k, k * self.page_size, context_len)

    def row_kv_tokens(self, row: RowPlan) -> float:
        """The KV a row reads, in KV tokens (``KVReads``)."""
        if row.kind == RowKind.DRAFT:
            return self.kv_reads.draft(self.sparse_tokens(row.context_len), row.context_len)
        if row.kind == RowKind.VERIFY:
            return self.kv_reads.full(row.context_len, row.num_tokens)
        return self.kv_reads.full(row.context_len)

    def step_features(self, rows: list[RowPlan]) -> tuple[int, float]:
        """(n_tokens, kv_tokens) of a step: the cost model's features, the same for the
        start-up sweep and the online samples."""
        return (sum(r.num_tokens for r in rows), sum(self.row_kv_tokens(r) for r in rows))

    def run_features(self, rows: list[RowPlan]) -> tuple[float, float]:
        """``step_features`` of the mean step of an asynchronous run (``RowPlan.async_gamma``;
        each row's context taken at the run's start)."""
        tokens = kv = 0.0
        tiles = self.kv_reads.full_by_queries(1, self.cfg.max_drafts + 1).tolist()  # by queries
        for row in rows:
            kinds = row.async_kinds()
            queries = [k + 1 for k in kinds if k >= 0]  # the row's verifications
            drafts, ctx = len(kinds) - len(queries), row.context_len
            tokens += drafts + sum(queries)
            kv += drafts * self.kv_reads.draft(self.sparse_tokens(ctx), ctx) + \
                ctx * sum(tiles[q - 1] for q in queries)  # fmt: skip
        steps = max(row.num_steps for row in rows)
        return tokens / steps, kv / steps

    def target(self, req: Request, batch: int, optimum: int | None = None) -> int:
        """The draft length this request aims for before verifying (the mode's gamma rule,
        ``config.MODES``); ``decide`` clamps it to ``max_drafts``. optimum: the cost model's
        choice where the batch was priced jointly (``marginal_gammas``)."""
        rule = self.cfg.mode_spec.gamma_rule
        if rule == "none":
            return 0
        if rule == "fixed":
            return self.cfg.gamma
        if rule == "fsm":
            return req.fsm_gamma
        # cost_model: the optimum, at least gamma_init before the first verification
        gamma = self.cost_optimal_gamma(req, batch) if optimum is None else optimum
        if not req.verified_once:
            gamma = max(gamma, self.cfg.gamma_init)
        if gamma == 0 and self.probe_due(req):
            gamma = 1  # probe: one draft, verified next step, feeds alpha and the cost model
        return gamma

    def cost_optimal_gamma(self, req: Request, batch: int) -> int:
        """The draft length that commits the most tokens per second in a batch of ``batch``
        requests like this one (``acceptance.best_gamma``): one draft step and a verification
        of each g <= max_drafts priced by the cost model, the verification's KV read once per
        query tile of its g + 1 queries. Coefficients that price a step at no cost: 0."""
        coef = self.cost_model.coef
        ctx = req.num_tokens + len(req.drafts)
        t_draft = coef.predict(batch, batch * self.kv_reads.draft(self.sparse_tokens(ctx), ctx))
        t_verify = [coef.predict(batch * (g + 1), batch * self.kv_reads.full(ctx, g + 1))
                    for g in range(self.cfg.max_drafts + 1)]  # fmt: skip
        if not (t_draft > 0 and min(t_verify) > 0):
            return 0
        return best_gamma(req.alpha, t_draft, t_verify)

    def marginal_gammas(self, reqs: list[Request], rounds: int = 8) -> list[int]:
        """Each request's cost-optimal draft length with its rows priced at what they add to a
        step (``SpecConfig.gamma_pricing`` "marginal").

        A step holds one row per request. Over a cycle of g draft steps and a verification,
        request i commits R_i(g) = E_i(g) / (g + 1) tokens a step and adds C_i(g) =
        (g * d_i + v_i(g)) / (g + 1) seconds to every step, with d_i, v_i(g) its draft and
        verify rows' b_tok and b_kv terms. The batch commits sum R / (b_model + sum C) tokens a
        second: a ratio of sums, maximized jointly by Dinkelbach's iteration. At a throughput
        lambda each request takes argmax_g R_i(g) - lambda * C_i(g); lambda is recomputed from
        those choices, from `ar`'s (lambda = 0: every g = 0) upwards, until no choice changes.
        A request of low alpha still drafts where its verify row's full KV read costs the batch
        more than its own tokens are worth; the homogeneous price (``cost_optimal_gamma``)
        charges it a whole draft step's b_model instead."""
        if not reqs:
            return []
        coef = self.cost_model.coef
        g = np.arange(self.cfg.max_drafts + 1)  # [G]
        # numpy over [B, G] (the driver prices every decoding request each plan)
        ctx = np.array([r.num_tokens + len(r.drafts) for r in reqs], dtype=np.int64)  # [B]
        d = coef.b_tok + coef.b_kv * self.kv_reads.draft(self.sparse_tokens_of(ctx), ctx)
        tiles = self.kv_reads.full_by_queries(1, len(g))  # [G] KV reads of a 1-token context
        v = coef.b_tok * (g + 1) + coef.b_kv * (ctx[:, None] * tiles)  # [B, G]
        a = np.minimum(np.array([r.alpha for r in reqs], dtype=np.float64), 1.0)[:, None]
        sure = a >= 1.0  # E(g) = g + 1 where every draft is accepted
        tokens = np.where(sure, g + 1.0, (1.0 - a ** (g + 1)) / np.where(sure, 1.0, 1.0 - a))
        gain = tokens / (g + 1)  # [B, G] R_i(g)
        cost = (g * d[:, None] + v) / (g + 1)  # [B, G] C_i(g)
        rows = np.arange(len(reqs))
        choice = np.zeros(len(reqs), dtype=np.int64)
        for _ in range(rounds):
            seconds = coef.b_model + cost[rows, choice].sum()
            if not seconds > 0:  # coefficients that price a step at no cost: as cost_optimal_gamma
                return [0] * len(reqs)
            lam = gain[rows, choice].sum() / seconds
            new = np.argmax(gain - lam * cost, axis=1)
            if np.array_equal(new, choice):
                break
            choice = new
        return choice.tolist()

    def targets(self, reqs: list[Request], caps: list[int]) -> list[int]:
        """Each decoding request's draft length, clamped to max_drafts and to its cap."""
        batch = len(reqs)
        optima: list[int | None] = [None] * batch
        if (self.cfg.mode_spec.gamma_rule == "cost_model"
                and self.cfg.gamma_pricing == "marginal" and self.cost_model is not None):
            optima = self.marginal_gammas(reqs)
        return [min(self.target(r, batch, o), self.cfg.max_drafts, cap)
                for r, cap, o in zip(reqs, caps, optima, strict=True)]  # fmt: skip

    def probe_due(self, req: Request) -> bool:
        """The request verified ``probe_every`` times without drafts: its next draft length
        of 0 becomes a one-draft probe (``target``)."""
        return req.plain_verifies >= self.cfg.probe_every

    @property
    def slotted(self) -> bool:
        """Whether ``align`` moves draft lengths (verify slots in an unsynchronized mode)."""
        return self.cfg.verify_quantum > 1 and not self.cfg.synchronized

    def keeps_its_target(self, req: Request, target: int) -> bool:
        """Whether ``align`` leaves the request's draft length alone: a seeded sampled request
        unless ``SpecConfig.slot_sampled`` or ``coupled_sampling`` (its draws follow its draft
        lengths, so its text would depend on the engine's step clock, i.e. on when it arrived;
        coupled, they do not; a request without a seed promises no text, so it takes the
        slots as greedy ones do) and a probe (one draft, the cheapest lesson for alpha and the
        cost model)."""
        probe = target == 1 and self.cfg.mode_spec.gamma_rule == "cost_model" \
            and self.probe_due(req)  # fmt: skip
        free = self.cfg.slot_sampled or self.cfg.coupled_sampling  # coupled: text fixed by seed
        seeded = req.params.seed is not None  # the driver draws one for the rest
        return probe or (not req.sampling.greedy and seeded and not free)

    def align(self, targets: list[int], held: list[int], step: int, caps: list[int],
              keep: list[bool] | None = None, steps: int | None = None) -> list[int]:  # fmt: skip
        """Each draft length moved to the nearest one (ties: the longer) whose next
        verification falls on a verify slot (``SpecConfig.verify_quantum``), for rows that
        hold held[i] drafts at decode step ``step`` (a row verifies at the first step where it
        holds its draft length); steps: the asynchronous run's length, where a row keeps its
        length for the whole run (``run_gamma``: the fewest verifications off the slots until
        the row is in phase). Unchanged: the synchronized modes, a target of 0 (a plain
        step every step), a row whose cap leaves no slot within reach, a row with keep[i]
        (``keeps_its_target``)."""
        q = self.cfg.verify_quantum
        if not self.slotted:
            return list(targets)
        # never past the query tile the target fits in: one more query there reads the KV again
        tile = self.kv_reads.query_tile
        keep = keep or [False] * len(targets)
        out = []
        for g, h, cap, k in zip(targets, held, caps, keep, strict=True):
            cap = cap if tile is None else min(cap, max(g, tile - 1))
            if k:
                out.append(g)
            elif steps is None:
                out.append(aligned_gamma(g, h, step, q, cap))
            else:
                out.append(run_gamma(g, h, step, q, cap, steps))
        return out

    def decide(self, reqs: list[Request], caps: list[int],
               step: int | None = None) -> list[Action]:  # fmt: skip
        """reqs: decoding requests; caps[i]: most drafts request i may still hold (stop limits);
        step: the decode step's index (its verify slots, ``align``; None: no slots)."""
        if not self.cfg.speculative:
            return [Action.VERIFY] * len(reqs)
        batch = len(reqs)
        targets = self.targets(reqs, caps)
        if step is not None and self.slotted:
            keep = [self.keeps_its_target(r, t) for r, t in zip(reqs, targets, strict=True)]
            targets = self.align(targets, [len(r.drafts) for r in reqs], step, caps, keep)
        if self.cfg.synchronized:
            if all(len(r.drafts) >= t for r, t in zip(reqs, targets, strict=True)):
                return [Action.VERIFY] * batch
            return [Action.DRAFT if len(r.drafts) < t else Action.IDLE
                    for r, t in zip(reqs, targets, strict=True)]
        return [Action.DRAFT if len(r.drafts) < t else Action.VERIFY
                for r, t in zip(reqs, targets, strict=True)]

    def chain_length(self, reqs: list[Request], caps: list[int],
                     actions: list[Action]) -> tuple[int, bool]:  # fmt: skip
        """(k, ends_round): draft steps the batch may run back to back (a draft chain,
        ``SpecConfig``) and whether the batch verifies right after them. In a synchronized mode
        where every request drafts or idles, k is the fewest drafts a drafting request still
        needs before the batch verifies, and the round ends with the chain when every request
        drafts and all need exactly k; (1, False) otherwise."""
        if not (self.cfg.synchronized and self.cfg.draft_chains) or Action.VERIFY in actions:
            return 1, False
        batch = len(reqs)
        left = [min(self.target(r, batch), self.cfg.max_drafts, cap) - len(r.drafts)
                for r, cap, a in zip(reqs, caps, actions, strict=True) if a == Action.DRAFT]
        if not left:
            return 1, False
        k = max(1, min(left))
        return k, self.cfg.chain_verify and len(left) == len(reqs) and max(left) == k

    def on_verified(self, req: Request, drafted: int, accepted: int) -> None:
        """After every verification of the request, d = 0 included."""
        if drafted == 0:
            req.plain_verifies += 1
            return
        self.num_probes += int(self.probe_due(req))
        req.plain_verifies = 0
        req.verified_once = True
        self.seen_accepted, self.seen_tried = update_pooled(
            self.seen_accepted, self.seen_tried, drafted, accepted, PRIOR_DECAY)
        if self.cfg.alpha_estimator == "pooled":
            req.alpha_accepted, req.alpha_tried = update_pooled(
                req.alpha_accepted, req.alpha_tried, drafted, accepted, self.cfg.alpha_ema)
            req.alpha = req.alpha_accepted / req.alpha_tried
        else:
            req.alpha = update_alpha(req.alpha, drafted, accepted, self.cfg.alpha_ema)
        if accepted == drafted:
            req.fsm_gamma = min(req.fsm_gamma + 1, self.cfg.fsm_max)
        else:
            req.fsm_gamma = max(req.fsm_gamma - 1, self.cfg.fsm_min)
