"""Three-term, batch-aware step-time model (DESIGN.md §1.5).

tau = b_model + b_tok * n_tokens + b_kv * kv_tokens, fitted by least squares from measured
step times. Only ratios of predictions matter to the scheduler (c_i = T_draft / T_verify).

kv_tokens counts KV *bytes* read in units of one token's K and V over all layers
(``KVReads``), so a draft row whose refresh layer reads the full list is charged for it.

What keeps the model honest (DESIGN.md §1.5, "learned the hard way"):
- every coefficient is bounded below by what the hardware allows (``CostBounds``: KV bytes
  per token and weight bytes over the bandwidth measured at start-up, and under tensor
  parallelism the all-reduces measured on the TP group, ``CollectiveCost``), so a noisy fit
  cannot make the KV term free (b_kv = 0 once made c ~ 1 and froze every request at gamma 0);
- a fit that cannot identify the three terms (too few distinct step shapes, an ill-conditioned
  design) or explains the data poorly (r² < ``min_r2``) keeps the prior's slopes and refits
  only the per-step term on the recent samples (an "offset" fit: a serving batch repeats one
  step shape, whose overhead is all it can tell), and where even that predicts a step of no
  cost, falls back to the prior itself;
- the prior is the start-up calibration of this deployment when there is one, else the
  physical prior (``CostBounds.physical_prior``: KV at the measured bandwidth), else ``PRIOR``
  (plus the collectives under tensor parallelism);
- the prediction error on measured steps is tracked by step kind (``PredictionErrors``).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class CostCoefficients:
    b_model: float  # seconds per step (weights read, launches, orchestration)
    b_tok: float  # seconds per query token
    b_kv: float  # seconds per KV token read (one token's K and V in every layer)
    r2: float | None = None  # goodness of the fit (None: prior, not fitted)
    samples: int = 0

    def predict(self, n_tokens: float, kv_tokens: float) -> float:
        return self.b_model + self.b_tok * n_tokens + self.b_kv * kv_tokens


# Prior where nothing was measured (a CPU worker has no bandwidth): a memory-bound step where a
# KV token costs about as much as a query token's share of weight traffic at batch 1.
PRIOR = CostCoefficients(b_model=1e-2, b_tok=1e-4, b_kv=1e-6)

# The attention kernels read KV at this multiple of the copy-bandwidth floor (H200, real Qwen
# 0.5B at 32k x 64, docs/profile_async_h200_qwen05b_32k_real_aspire_fixed.json: full-list rows
# 1.0-1.26x, sparse draft rows ~1.4x); the KV rate of the physical prior.
KV_READ_FACTOR = 1.3
# An offset fit (the per-step term alone) takes the median over the latest samples measured
# since the prior was set (the start-up sweep's own steps pay a host round trip each that
# served steps do not)
OFFSET_WINDOW = 64
MIN_OFFSET_SAMPLES = 2

# A bound must never exceed the truth: attention kernels that only read can beat the rate of
# the copy that measures the bandwidth by a few percent, and small weights partly hit L2.
BOUND_FRACTION = 0.8
MIN_R2 = 0.8  # on-line fits on an H200 score 0.92-0.99; the broken ones 0.0003-0.47
MIN_SHAPES = 6  # distinct (n_tokens, kv_tokens within ~19%) step shapes a fit needs
# Condition number of the design with unit-norm columns: calibration sweeps ~2-3, on-line mixed
# steps ~30; a draining `ar` batch (n_tokens and kv_tokens both ~ B) ~2,400, where b_tok and
# b_kv trade off freely.
MAX_CONDITION = 1e3


@dataclass(frozen=True)
class CollectiveCost:
    """What one forward's tensor-parallel collectives cost (seconds), from the all-reduce
    measured on the TP group at start-up (``tp.collective_cost``). Every layer all-reduces its
    [n_tokens, hidden] output twice (attention, MLP) and the vocab-parallel embedding once:
    2L + 1 calls whose bytes grow with n_tokens. The LM head's all-gather adds one call's
    latency; its bytes follow the logit rows, not n_tokens, and are left out, as is the refresh
    layer's page-score all-reduce (only some steps score): a bound must not exceed the truth.
    Zero at TP=1."""

    per_step: float = 0.0  # seconds per forward: the calls' latency
    per_token: float = 0.0  # seconds per query token: its activations in every all-reduce

    @classmethod
    def from_all_reduce(cls, num_layers: int, latency: float, per_token: float) -> CollectiveCost:
        """One all-reduce of [n, hidden] taking latency + per_token * n seconds."""
        calls = 2 * num_layers + 1
        return cls(per_step=(calls + 1) * latency, per_token=calls * per_token)

    def added_to(self, coef: CostCoefficients) -> CostCoefficients:
        return CostCoefficients(coef.b_model + self.per_step, coef.b_tok + self.per_token,
                                coef.b_kv, coef.r2, coef.samples)  # fmt: skip


@dataclass(frozen=True)
class CostBounds:
    """Lower bounds on the coefficients (seconds), from start-up measurements."""

    b_model: float = 0.0
    b_tok: float = 0.0
    b_kv: float = 0.0
    collective: CollectiveCost = CollectiveCost()  # included in b_model and b_tok

    @classmethod
    def from_device(
        cls, kv_bytes_per_token: float | None, weight_bytes: float | None,
        bandwidth: float | None, collective: CollectiveCost | None = None,
    ) -> CostBounds:
        """b_kv >= KV bytes per token / bandwidth, b_model >= weight bytes / bandwidth (the
        bytes of one shard over its bandwidth, bytes/s) + the collectives' latency, b_tok >=
        the collectives' per-token time, all times ``BOUND_FRACTION``; where the worker
        measured no bandwidth (CPU), the collectives alone."""
        coll = collective or CollectiveCost()
        weights = (weight_bytes or 0.0) / bandwidth if bandwidth and bandwidth > 0 else 0.0
        kv = (kv_bytes_per_token or 0.0) / bandwidth if bandwidth and bandwidth > 0 else 0.0
        return cls(
            b_model=BOUND_FRACTION * (weights + coll.per_step),
            b_tok=BOUND_FRACTION * coll.per_token,
            b_kv=BOUND_FRACTION * kv,
            collective=coll,
        )

    def clamp(self, coef: CostCoefficients) -> CostCoefficients:
        return CostCoefficients(
            max(coef.b_model, self.b_model),
            max(coef.b_tok, self.b_tok),
            max(coef.b_kv, self.b_kv),
            coef.r2,
            coef.samples,
        )

    def as_array(self) -> np.ndarray:
        return np.array([self.b_model, self.b_tok, self.b_kv])

    def physical_prior(self) -> CostCoefficients | None:
        """What the measurements alone say a step costs: the weights read once per step and
        the collectives' latency, KV at ``KV_READ_FACTOR`` x its floor, query tokens only
        their collectives (a memory-bound batch). None where no bandwidth was measured. Its
        per-step term is only a start: the offset fit replaces it."""
        if self.b_kv <= 0:
            return None
        return CostCoefficients(self.b_model / BOUND_FRACTION, self.b_tok / BOUND_FRACTION,
                                KV_READ_FACTOR * self.b_kv / BOUND_FRACTION)

    def default_prior(self) -> CostCoefficients:
        """The prior without a calibration: the physical prior, else ``PRIOR`` plus the
        collectives (a TP step pays them on top of what one device does)."""
        return self.physical_prior() or self.collective.added_to(PRIOR)


@dataclass(frozen=True)
class KVReads:
    """KV read by one row of a step, in KV tokens (one token's K and V in every layer), so that
    b_kv is a per-byte rate and the physics bound applies to it.

    A row over c tokens of context reads c in every layer: c. A draft row reads its sparse list
    S_i in every layer but the refresh layer l_r; where the policy refreshes while drafting,
    l_r attends over the full list (K and V) and scores its pages (K again, half the bytes):
    ((L - 1) * |S_i| + 1.5 * c) / L. At 32k context, 24 layers and |S_i| = 2,304 tokens that is
    3,573 KV tokens, 1.55x the sparse list alone. Scoring a verify row's first and last query
    (c / L more, ~4%) is left out: it is proportional to c, so b_kv absorbs it.
    """

    num_layers: int
    refresh_while_drafting: bool
    # query tokens of a row that share one KV read (``ShardInfo.query_tile_tokens``); None:
    # one read for any query count
    query_tile: int | None = None

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.query_tile is not None and self.query_tile < 1:
            raise ValueError(f"query_tile must be >= 1 or None, got {self.query_tile}")

    def draft(self, sparse_tokens: int | np.ndarray,
              context_tokens: int | np.ndarray) -> float | np.ndarray:
        """KV tokens a draft row reads; scalars or numpy arrays of rows (the policy prices
        every row's context at once)."""
        if not self.refresh_while_drafting:
            return np.multiply(sparse_tokens, 1.0)  # a float, or a float array of the rows
        n = self.num_layers
        return ((n - 1) * sparse_tokens + 1.5 * context_tokens) / n

    def full(self, context_tokens: int, queries: int = 1) -> float:
        """A verify row of ``queries`` queries: the full list in every layer, once per query
        tile (a 6-query row of 7-head groups fits one 64-row tile; a 10-query row needs two,
        and reads its KV twice: docs/benchmarks.md §8.20). Prefill chunks are charged one
        read (their per-token term b_tok absorbs the rest)."""
        tiles = 1 if self.query_tile is None else -(-queries // self.query_tile)
        return float(context_tokens * tiles)

    def full_by_queries(self, context_tokens: int, max_queries: int) -> np.ndarray:
        """[max_queries] ``full(context_tokens, q)`` for q = 1..max_queries."""
        q = np.arange(1, max_queries + 1)
        tiles = np.ones_like(q) if self.query_tile is None else -(-q // self.query_tile)
        return (context_tokens * tiles).astype(np.float64)


@dataclass
class PredictionErrors:
    """Relative error (predicted - measured) / measured of the model in force at each step, by
    step kind ("draft", "verify", "mixed" draft + verify, "prefill": any prefill row)."""

    steps: dict[str, int] = field(default_factory=dict)
    abs_sum: dict[str, float] = field(default_factory=dict)  # sum of |relative error|
    sum: dict[str, float] = field(default_factory=dict)  # sum of relative error (bias)

    def record(self, kind: str, predicted: float, measured: float) -> None:
        if measured <= 0 or not math.isfinite(predicted):
            return
        err = (predicted - measured) / measured
        self.steps[kind] = self.steps.get(kind, 0) + 1
        self.abs_sum[kind] = self.abs_sum.get(kind, 0.0) + abs(err)
        self.sum[kind] = self.sum.get(kind, 0.0) + err

    def summary(self) -> dict[str, dict[str, float]]:
        """kind -> steps, mean_abs (mean |relative error|), mean (bias; > 0: over-predicts),
        plus the sums, so that a caller can difference two snapshots over a window."""
        return {
            k: {
                "steps": n,
                "mean_abs": self.abs_sum[k] / n,
                "mean": self.sum[k] / n,
                "abs_sum": self.abs_sum[k],
                "sum": self.sum[k],
            }
            for k, n in sorted(self.steps.items())
        }


class CostModel:
    """The coefficients in force (``coef``), the prior they fall back to, and the sample window.

    Call order: ``set_prior`` once after start-up calibration (optional); ``predict`` /
    ``add_sample`` every step; ``fit`` every few steps.
    """

    def __init__(
        self,
        window: int = 2048,
        min_samples: int = 16,
        prior: CostCoefficients | None = None,
        bounds: CostBounds | None = None,
        min_r2: float = MIN_R2,
        min_shapes: int = MIN_SHAPES,
        offset_window: int = OFFSET_WINDOW,
    ) -> None:
        self.bounds = bounds or CostBounds()
        self.min_samples = min_samples
        self.min_r2 = min_r2
        self.min_shapes = min_shapes
        self.offset_window = offset_window
        if prior is None:
            prior = self.bounds.default_prior()
        self.prior = self.bounds.clamp(prior)
        self.coef = self.prior
        # "fit" (all three terms), "offset: <why not all three>" (the prior's slopes, the
        # per-step term fitted), "prior" or "prior: <why not even the offset>"
        self.status = "prior"
        self.fallbacks = 0  # full fits refused (offset fit or prior in force instead)
        self.errors = PredictionErrors()
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=window)
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=offset_window)
        self._refitted = False  # a fit tried since the prior was set

    @property
    def fitted(self) -> bool:
        return self.status == "fit"

    def set_prior(self, coef: CostCoefficients) -> None:
        """The calibrated prior (the start-up fit of this deployment), also put in force."""
        self.prior = self.bounds.clamp(coef)
        self.coef = self.prior
        self._recent.clear()  # the samples it was fitted to are not the offset's
        self._refitted = False

    @property
    def wants_first_refit(self) -> bool:
        """Whether served steps enough for an offset fit were measured and none was tried
        since the prior was set: the prior of a start-up sweep prices host round trips that
        served steps do not pay, so the first refit should not wait ``refit_every`` steps."""
        return not self._refitted and len(self._recent) >= MIN_OFFSET_SAMPLES \
            and len(self._samples) >= self.min_samples  # fmt: skip

    def add_sample(self, n_tokens: float, kv_tokens: float, seconds: float) -> None:
        sample = (float(n_tokens), float(kv_tokens), float(seconds))
        self._samples.append(sample)
        self._recent.append(sample)

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def fit(self) -> CostCoefficients:
        """Refit from the sample window (bounded least squares). With fewer than min_samples
        samples nothing changes; where the three terms cannot be fitted the offset fit is in
        force, and where it predicts steps of no cost, the prior."""
        if len(self._samples) < self.min_samples:
            return self.coef
        self._refitted = True
        data = np.array(self._samples)
        why = self._unidentifiable(data)
        if why is None:
            coef = self.fit_terms(data, (True, True, True), self.bounds)
            pred = _design(data) @ _array(coef)
            if not (pred > 0).all():
                why = "predicts steps of no cost"
            elif coef.r2 < self.min_r2:
                why = f"r2 {coef.r2:.3f} < {self.min_r2}"
            else:
                self.coef, self.status = coef, "fit"
                return coef
        self.fallbacks += 1
        recent = np.array(self._recent).reshape(-1, 3)
        if len(recent) >= MIN_OFFSET_SAMPLES:
            x, y = _design(recent), recent[:, 2]
            # the median, not the mean: a step that captured a CUDA graph costs seconds (an
            # H200's first runs put the mean at 58 ms for steps of ~4.6 ms)
            slopes = x[:, 1:] @ _array(self.prior)[1:]  # [S] seconds of tokens and KV
            intercept = float(np.median(y - slopes))
            # the prior's slopes alone must not over-predict the steps (the per-step term
            # would sit at its bound and explain nothing: those slopes are wrong here)
            if intercept > 0 and intercept >= self.bounds.b_model:
                p = self.prior
                offset = CostCoefficients(intercept, p.b_tok, p.b_kv, r2=_r2(y, intercept + slopes),
                                          samples=len(recent))  # fmt: skip
                self.coef, self.status = offset, f"offset: {why}"
                return offset
        self.coef, self.status = self.prior, f"prior: {why}"
        return self.coef

    def fit_terms(self, data: np.ndarray, free: tuple[bool, bool, bool],
                  fixed: CostCoefficients | CostBounds) -> CostCoefficients:
        """Least squares of the ``free`` terms over samples [S, 3] (n_tokens, kv_tokens,
        seconds), each no lower than its bound; the other terms taken from ``fixed``."""
        x, y = _design(data), data[:, 2]
        beta = np.maximum(_array(fixed), self.bounds.as_array())
        cols = [i for i in range(3) if free[i]]
        rest = y - x[:, [i for i in range(3) if not free[i]]] @ beta[[not f for f in free]]
        beta[cols] = _bounded_lstsq(x[:, cols], rest, self.bounds.as_array()[cols])
        return CostCoefficients(*map(float, beta), r2=_r2(y, x @ beta), samples=len(data))

    def _unidentifiable(self, data: np.ndarray) -> str | None:
        """Why these samples cannot pin down three terms, or None."""
        kv_bucket = np.round(4 * np.log2(1.0 + data[:, 1]))  # quarter octaves
        shapes = len(np.unique(np.column_stack([data[:, 0], kv_bucket]), axis=0))
        if shapes < self.min_shapes:
            return f"{shapes} distinct step shapes < {self.min_shapes}"
        x = _design(data)
        norms = np.linalg.norm(x, axis=0)
        if (norms == 0).any():
            return "a feature is always 0"
        cond = np.linalg.cond(x / norms)
        if not cond <= MAX_CONDITION:
            return f"ill-conditioned design (condition {cond:.3g})"
        return None

    def predict(self, n_tokens: float, kv_tokens: float) -> float:
        return self.coef.predict(n_tokens, kv_tokens)

    def draft_verify_ratio(
        self, batch: int, draft_kv_tokens: float, drafts: int, context_tokens: int
    ) -> float:
        """c_i for a homogeneous batch of B requests like request i; draft_kv_tokens is one
        draft row's KV read (``KVReads.draft``). Coefficients that predict no cost (a verify
        step of time <= 0) give 1: drafting no cheaper than verifying."""
        b = self.coef
        t_draft = b.b_model + b.b_tok * batch + b.b_kv * batch * draft_kv_tokens
        t_verify = b.b_model + b.b_tok * batch * (drafts + 1) + b.b_kv * batch * context_tokens
        if not t_verify > 0:
            return 1.0
        return t_draft / t_verify

    def summary(self) -> dict:
        """For engine stats: the coefficients in force, where they come from, the bounds, the
        prior, the collective term (TP > 1; zero at TP=1) and the prediction error by step
        kind."""
        c, p, lb = self.coef, self.prior, self.bounds
        return {
            "b_model": c.b_model,
            "b_tok": c.b_tok,
            "b_kv": c.b_kv,
            "r2": c.r2,
            "samples": self.num_samples,
            "status": self.status,
            "fallbacks": self.fallbacks,
            "prior": {"b_model": p.b_model, "b_tok": p.b_tok, "b_kv": p.b_kv, "r2": p.r2},
            "bounds": {"b_model": lb.b_model, "b_tok": lb.b_tok, "b_kv": lb.b_kv},
            "collective": {"per_step": lb.collective.per_step,
                           "per_token": lb.collective.per_token},
            "prediction_error": self.errors.summary(),
        }


def _r2(y: np.ndarray, pred: np.ndarray) -> float:
    """Coefficient of determination; times that do not vary (to rounding) are explained
    perfectly by a fit that matches them, and not at all otherwise."""
    scale = float((y**2).sum())
    total = float(((y - y.mean()) ** 2).sum())
    resid = float(((y - pred) ** 2).sum())
    if total <= 1e-12 * scale:
        return 1.0 if resid <= 1e-12 * scale else 0.0
    return 1.0 - resid / total


def _design(data: np.ndarray) -> np.ndarray:
    """[S, 3] samples (n_tokens, kv_tokens, seconds) -> the design [S, 3] (1, n_tokens, kv)."""
    return np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])


def _array(coef: CostCoefficients | CostBounds) -> np.ndarray:
    return np.array([coef.b_model, coef.b_tok, coef.b_kv], dtype=float)


def _bounded_lstsq(x: np.ndarray, y: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """Least squares with beta >= lower over k <= 3 unknowns: beta = lower + z, z >= 0, the
    best of all 2^k active sets (the optimum is the unconstrained solution on its support)."""
    k = x.shape[1]
    r = y - x @ lower
    best, best_err = np.zeros(k), float((r**2).sum())  # the empty support: beta = lower
    for mask in range(1, 2**k):
        cols = [i for i in range(k) if mask >> i & 1]
        sub, *_ = np.linalg.lstsq(x[:, cols], r, rcond=None)
        if (sub < 0).any():
            continue
        z = np.zeros(k)
        z[cols] = sub
        err = float(((r - x @ z) ** 2).sum())
        if err < best_err:
            best, best_err = z, err
    return lower + best
