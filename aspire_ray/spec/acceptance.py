"""Per-request acceptance estimate and the cost-optimal draft length (DESIGN.md §1.5)."""

from __future__ import annotations


def update_alpha(alpha: float, drafted: int, accepted: int, ema: float = 0.8) -> float:
    """EMA of alpha_hat = a / min(a + 1, d); a round with d = 0 drafts leaves alpha unchanged."""
    if drafted == 0:
        return alpha
    alpha_hat = accepted / min(accepted + 1, drafted)
    return ema * alpha + (1.0 - ema) * alpha_hat


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
