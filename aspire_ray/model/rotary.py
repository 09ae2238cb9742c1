"""Rotary position embedding (neox / HF rotate-half layout), with llama3-style scaling."""

from __future__ import annotations

import functools
import importlib.util
import math

import torch
from torch import nn

from aspire_ray.kernels.reference import rotary_ref, store_kv_ref


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, max_positions: int,
                 scaling: dict | None) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                    / head_dim))
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif kind == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif kind is not None:
            raise ValueError(f"unsupported rope scaling {kind!r} (supported: llama3, linear)")
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_pos, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                q_out: torch.Tensor | None = None,
                kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """positions [T] int64; q [T, Hq, D], k [T, Hkv, D] -> rotated (same dtype).

        On a GPU one fused kernel rotates k in place and q in place or into ``q_out[:T]`` (a
        static buffer of the CUDA-graph path); elsewhere new tensors (copied into q_out if given).
        kv: (v, kv_cache, slot_mapping): the rotated k and v stored there too (on a GPU in the
        same launch, ``kernels.rope``).
        """
        if fused_ops(q):
            from aspire_ray.kernels.rope import rotary_embedding

            return rotary_embedding(positions, q, k, self.cos, self.sin, q_out, kv), k
        q, k = rotary_ref(positions, q, self.cos, self.sin), rotary_ref(positions, k, self.cos,
                                                                          self.sin)  # fmt: skip
        if q_out is not None:
            q = q_out[: q.shape[0]].copy_(q)
        if kv is not None:
            store_kv_ref(k, kv[0], kv[1], kv[2])
        return q, k


@functools.cache
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_ops(x: torch.Tensor) -> bool:
    """Whether x's device runs the fused Triton kernels (CUDA with triton installed); the CPU
    keeps the pure-torch ops, which match transformers op for op."""
    return x.is_cuda and _triton_available()
