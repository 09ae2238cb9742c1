"""Three-term, batch-aware step-time model (DESIGN.md §1.5).

tau = b_model + b_tok * n_tokens + b_kv * kv_tokens_read, fitted by least squares from measured
step times. Only ratios of predictions matter to the scheduler (c_i = T_draft / T_verify).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostCoefficients:
    b_model: float  # seconds per step (weights read, launches, orchestration)
    b_tok: float  # seconds per query token
    b_kv: float  # seconds per KV token read
    r2: float | None = None  # goodness of the fit (None: prior, not fitted)
    samples: int = 0

    def predict(self, n_tokens: float, kv_tokens: float) -> float:
        return self.b_model + self.b_tok * n_tokens + self.b_kv * kv_tokens


# Prior until the first fit: a memory-bound step where a KV token costs about as much as a
# query token's share of weight traffic at batch 1. Replaced by the fit as soon as possible.
PRIOR = CostCoefficients(b_model=1e-2, b_tok=1e-4, b_kv=1e-6)


class CostModel:
    def __init__(self, window: int = 2048, min_samples: int = 16,
                 prior: CostCoefficients = PRIOR) -> None:
        self.coef = prior
        self.min_samples = min_samples
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=window)

    def add_sample(self, n_tokens: int, kv_tokens: int, seconds: float) -> None:
        self._samples.append((float(n_tokens), float(kv_tokens), float(seconds)))

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def fit(self) -> CostCoefficients:
        """Refit from the sample window; keeps the old coefficients if the data can't identify
        all three terms or gives a negative one."""
        if len(self._samples) < self.min_samples:
            return self.coef
        data = np.array(self._samples)
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        y = data[:, 2]
        if np.linalg.matrix_rank(x) < 3:
            return self.coef
        beta, *_ = np.linalg.lstsq(x, y, rcond=None)
        if (beta < 0).any():
            beta = _nonnegative_lstsq(x, y)
        resid = y - x @ beta
        total = ((y - y.mean()) ** 2).sum()
        r2 = 1.0 - (resid**2).sum() / total if total > 0 else 1.0
        self.coef = CostCoefficients(*map(float, beta), r2=float(r2), samples=len(data))
        return self.coef

    def draft_verify_ratio(self, batch: int, sparse_tokens: int, drafts: int,
                           context_tokens: int) -> float:
        """c_i for a homogeneous batch of B requests like request i."""
        b = self.coef
        t_draft = b.b_model + b.b_tok * batch + b.b_kv * batch * sparse_tokens
        t_verify = b.b_model + b.b_tok * batch * (drafts + 1) + b.b_kv * batch * context_tokens
        return t_draft / t_verify


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with beta >= 0 over 3 unknowns: best over all active sets (2^3 = 8)."""
    best, best_err = np.zeros(3), float("inf")
    for mask in range(1, 8):
        cols = [i for i in range(3) if mask >> i & 1]
        sub, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (sub < 0).any():
            continue
        beta = np.zeros(3)
        beta[cols] = sub
        err = float(((y - x @ beta) ** 2).sum())
        if err < best_err:
            best, best_err = beta, err
    return best
