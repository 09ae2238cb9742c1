"""Per-request acceptance estimate and the cost-optimal draft length (DESIGN.md §1.5)."""

from __future__ import annotations

from collections.abc import Sequence


def update_alpha(alpha: float, drafted: int, accepted: int, ema: float = 0.8) -> float:
    """EMA of alpha_hat = a / min(a + 1, d); a round with d = 0 drafts leaves alpha unchanged."""
    if drafted == 0:
        return alpha
    alpha_hat = accepted / min(accepted + 1, drafted)
    return ema * alpha + (1.0 - ema) * alpha_hat


def update_pooled(accepted_sum: float, tried_sum: float, drafted: int, accepted: int,
                  ema: float = 0.8) -> tuple[float, float]:
    """EMA sums of drafts accepted and drafts tried: a round that accepts a of d drafts tried
    min(a + 1, d) of them (the first rejection ends it). Their ratio estimates alpha without
    ``update_alpha``'s bias: the expectation of a / min(a + 1, d) over a round is below alpha
    (0.72-0.81 for alpha = 0.87 and d = 8-2: a short round that is rejected early weighs as
    much as a long one), but E[a] / E[min(a + 1, d)] = alpha exactly for i.i.d. acceptance.
    A round with d = 0 leaves both unchanged."""
    if drafted == 0:
        return accepted_sum, tried_sum
    return ema * accepted_sum + accepted, ema * tried_sum + min(accepted + 1, drafted)


def expected_tokens(alpha: float, g: int) -> float:
    """Tokens a verification of g drafts commits in expectation: (1 - a^(g+1)) / (1 - a)."""
    if alpha >= 1.0:
        return float(g + 1)
    return (1.0 - alpha ** (g + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, c: float, g: int) -> float:
    """Committed tokens per unit of verify time for g drafts: (1 - a^(g+1)) / ((1 - a)(1 + c g))."""
    if alpha >= 1.0:
        return (g + 1) / (1.0 + c * g)
    return (1.0 - alpha ** (g + 1)) / ((1.0 - alpha) * (1.0 + c * g))


def optimal_gamma(alpha: float, c: float, d_max: int) -> int:
    """argmax over g in 0..d_max of expected_speedup (first maximum on ties).

    The speedup is a concave increasing function of g over a positive affine one, hence
    quasi-concave: after its first strict decrease it never again exceeds the best so far, so
    the scan stops there (this runs for every decoding request every step)."""
    best_g, best = 0, expected_speedup(alpha, c, 0)
    for g in range(1, d_max + 1):
        value = expected_speedup(alpha, c, g)
        if value > best:
            best_g, best = g, value
        elif value < best:
            break
    return best_g


def best_gamma(alpha: float, t_draft: float, t_verify: Sequence[float]) -> int:
    """argmax over g in 0..len(t_verify) - 1 of the tokens a round commits per second,
    ``expected_tokens(alpha, g) / (g * t_draft + t_verify[g])`` (first maximum on ties).

    t_verify[g]: the time of a verification of g drafts. With one time for every g this is
    ``optimal_gamma`` with c = t_draft / t_verify; where the time steps up (a row of g + 1
    queries that needs another query tile reads its KV once more) the ratio is not
    quasi-concave, so every g is scanned."""
    best_g, best = 0, -1.0
    for g, t_v in enumerate(t_verify):
        value = expected_tokens(alpha, g) / (g * t_draft + t_v)
        if value > best:
            best_g, best = g, value
    return best_g
