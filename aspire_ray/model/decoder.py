"""One decoder for the Llama, Qwen2 and Qwen3 families (flags from ModelArch).

The model knows nothing of scheduling: attention goes through an ``AttentionPlan`` object
(built by the worker once per step) that stores K/V into the paged cache and attends with
each layer's page lists. Shapes: T = tokens of the flattened ragged batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
from torch import nn

from aspire_ray.kernels.reference import rms_norm_ref, silu_and_mul_ref
from aspire_ray.tp import TPGroup
from aspire_ray.tp.group import shard_heads
from aspire_ray.tp.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)

from .arch import ModelArch
from .rotary import RotaryEmbedding, fused_ops


class AttentionPlan(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (after RoPE) -> attention output [T, Hq, D]."""


class MLPPartials(NamedTuple):
    """An MLP's output left as float32 [S, T, hidden] per-slice partials of its down projection
    (``kernels/mlp_partials.py``), summed by the next RMSNorm with the residual add."""

    parts: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor | MLPPartials,
                residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """x [..., N]. With residual [T, N]: residual += x in place, returns the norm of it
        (x an ``MLPPartials``: their sum, in the same launch).

        Same op order as transformers' LlamaRMSNorm (fp32 statistics) for exact fp32 parity on
        the CPU; one fused kernel on a GPU."""
        if isinstance(x, MLPPartials):
            from aspire_ray.kernels.fused_norm import rms_norm_parts

            return rms_norm_parts(x.parts, self.weight, self.eps, residual)
        if fused_ops(x):
            from aspire_ray.kernels.fused_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        return rms_norm_ref(x, self.weight, self.eps, residual)


# Steps of at most this many tokens run the qkv projection with RoPE + the KV store, and the
# gate/up projection with SiLU-and-multiply, in one launch each (kernels/qkv_rope.py,
# gate_up_silu.py) in place of two or three: ~1-1.7 us a layer fewer at 64-128 tokens on an
# H100 (docs/benchmarks.md §8.35). Longer steps keep cuBLAS and the separate kernels: at 256
# tokens the fused gate/up is 1.4x cuBLAS + SiLU (the qkv still 0.92x).
QKV_ROPE_MAX_TOKENS = 256
GATE_UP_SILU_MAX_TOKENS = 128
# Steps of at most this many tokens may run the o / down projections through kernels/linear.py
# (``set_triton_projections``): decode-sized, where cuBLAS's launch edge is the cost.
TRITON_PROJECTION_MAX_TOKENS = 256
# Steps of at most this many tokens may run the whole MLP as one launch (``set_fused_mlp``).
FUSED_MLP_MAX_TOKENS = 128
_HALF = (torch.bfloat16, torch.float16)


def set_fused_epilogues(model: nn.Module, on: bool) -> None:
    """Decode-sized steps of ``model`` through the fused-epilogue projections (on, the default
    on a GPU) or the separate kernels (off: ``EngineConfig.fused_epilogues``)."""
    for m in model.modules():
        if isinstance(m, (Attention, MLP)):
            m.fused_epilogues = on


def set_fused_mlp(model: nn.Module, on: bool) -> None:
    """Decode-sized bf16 / fp16 steps of ``model`` on a GPU run each MLP as one launch whose
    down projection's sum the next RMSNorm finishes (``kernels/mlp_partials.py``; on:
    ``EngineConfig.fused_mlp``); one rank only (the down projection's all-reduce needs the
    sum), never in the deterministic mode (its rounding is not the unfused path's)."""
    for m in model.modules():
        if isinstance(m, MLP):
            m.fused_mlp = on and m.down_proj.tp.size == 1


def set_triton_projections(model: nn.Module, names: tuple[str, ...]) -> None:
    """Decode-sized bf16 / fp16 steps of ``model`` on a GPU run the named row-parallel
    projections ("o", "down": ``EngineConfig.triton_projections``) through kernels/linear.py,
    the others through cuBLAS."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.o_proj.triton_rows = TRITON_PROJECTION_MAX_TOKENS if "o" in names else 0
        elif isinstance(m, MLP):
            m.down_proj.triton_rows = TRITON_PROJECTION_MAX_TOKENS if "down" in names else 0


def fused_epilogue(x: torch.Tensor, max_tokens: int) -> bool:
    """Whether a projection of x [T, hidden] runs a fused-epilogue kernel (a GPU, Triton,
    bf16 / fp16, at most max_tokens tokens). In the deterministic mode as well: those kernels
    tile as ``invariant_linear`` does, so a row's bits do not depend on which path ran it.
    float32 keeps cuBLAS: the fp32 runs that check exactness compare steps of every size, and
    a Triton product is not bitwise cuBLAS's (before ``linear.dot_precision`` its dot also took
    float32 as tf32: ``magicdec``'s fp32 graphs parted from eager on an H100, §8.35)."""
    return (x.dim() == 2 and x.shape[0] <= max_tokens and x.dtype in _HALF
            and fused_ops(x))  # fmt: skip


class Attention(nn.Module):
    fused_epilogues = True  # set_fused_epilogues

    def __init__(self, arch: ModelArch, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.layer = layer
        self.q_heads, self.kv_heads, kv_start = shard_heads(arch.num_heads, arch.num_kv_heads, tp)
        self.head_dim = arch.head_dim
        self.scale = arch.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, self.q_heads,
                                          self.kv_heads, kv_start, arch.qkv_bias, tp)
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size,
                                        False, tp)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.qk_norm else None

    def qkv(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
            q_out: torch.Tensor | None = None,
            kv: tuple[torch.Tensor, torch.Tensor] | None = None):  # fmt: skip
        """x [T, hidden] -> q [T, Hq, D], k, v [T, Hkv, D] after q/k norm and RoPE (q written
        into q_out[:T] when given; with kv = (kv_cache, slot_mapping) k and v stored there by
        RoPE's launch)."""
        t = x.shape[0]
        if self.fused_epilogues and self.q_norm is None and fused_epilogue(x, QKV_ROPE_MAX_TOKENS):
            from aspire_ray.kernels.qkv_rope import qkv_rope

            proj = self.qkv_proj
            cache, slots = kv if kv is not None else (None, None)
            return qkv_rope(x, proj.weight, proj.bias, positions, rotary.cos, rotary.sin, q_out,
                            cache, slots, self.q_heads, self.kv_heads, self.head_dim)  # fmt: skip
        q_size, kv_size = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, self.q_heads, self.head_dim)
        k = k.view(t, self.kv_heads, self.head_dim)
        v = v.view(t, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k, q_out, None if kv is None else (v, *kv))
        return q, k, v

    def forward(self, x, positions, rotary, plan: AttentionPlan, kv_cache):
        q, k, v = self.qkv(x, positions, rotary)
        out = plan.attend(self.layer, q, k, v, kv_cache, self.scale)
        return self.o_proj(out.reshape(x.shape[0], -1))


class MLP(nn.Module):
    fused_epilogues = True  # set_fused_epilogues
    fused_mlp = False  # set_fused_mlp

    def __init__(self, arch: ModelArch, tp: TPGroup) -> None:
        super().__init__()
        inter = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [inter, inter], False, tp)
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor | MLPPartials:
        """x [T, hidden] -> the MLP's output [T, hidden], or its partials (``set_fused_mlp``)
        for the next RMSNorm."""
        if self.fused_mlp and self.gate_up_proj.bias is None and self.down_proj.bias is None \
                and fused_epilogue(x, FUSED_MLP_MAX_TOKENS):  # fmt: skip
            from aspire_ray.kernels.mlp_partials import mlp_partials

            return MLPPartials(mlp_partials(x, self.gate_up_proj.weight, self.down_proj.weight))
        if self.fused_epilogues and self.gate_up_proj.bias is None and fused_epilogue(
                x, GATE_UP_SILU_MAX_TOKENS):
            from aspire_ray.kernels.gate_up_silu import gate_up_silu

            return self.down_proj(gate_up_silu(x, self.gate_up_proj.weight))
        gate_up = self.gate_up_proj(x)
        if fused_ops(gate_up):
            from aspire_ray.kernels.activation import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        return self.down_proj(silu_and_mul_ref(gate_up))


class DecoderLayer(nn.Module):
    """One layer over the residual stream, which it updates in place (vLLM's fused residual):
    the previous layer's MLP output x is added to the residual inside the input norm."""

    def __init__(self, arch: ModelArch, layer: int, tp: TPGroup) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, layer, tp)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch, tp)

    def pre_attention(self, x: torch.Tensor | None, residual: torch.Tensor, positions, rotary,
                      q_out: torch.Tensor | None = None,
                      kv: tuple[torch.Tensor, torch.Tensor] | None = None):  # fmt: skip
        """residual += x (x None: the embeddings already are the residual) -> q, k, v (kv:
        ``Attention.qkv``'s, the KV store in RoPE's launch)."""
        h = self.input_layernorm(residual) if x is None else self.input_layernorm(x, residual)
        return self.self_attn.qkv(h, positions, rotary, q_out, kv)

    def post_attention(self, attn: torch.Tensor,
                       residual: torch.Tensor) -> torch.Tensor | MLPPartials:  # fmt: skip
        """attn [T, Hq, D]: o_proj, residual add, norm, MLP -> the MLP output [T, hidden]
        (or its partials, which the next norm sums)."""
        h = self.self_attn.o_proj(attn.reshape(attn.shape[0], -1))
        return self.mlp(self.post_attention_layernorm(h, residual))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] -> int64 [N]: ``kernels.argmax`` on a GPU, torch's elsewhere."""
    if fused_ops(logits):
        from aspire_ray.kernels.argmax import argmax_rows

        return argmax_rows(logits)
    return logits.argmax(dim=-1)


class DecoderModel(nn.Module):
    """Embedding -> N decoder layers -> final norm; ``compute_logits`` for selected tokens."""

    # HF checkpoint name -> (our parameter name, shard id for fused layers)
    STACKED = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, arch: ModelArch, tp: TPGroup) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp  # the shard's group: the refresh layer's page scores take a max over it
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, tp) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tp)
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta,
                                      arch.max_position_embeddings, arch.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan,
                kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, hidden]."""
        layers = self.layers

        def attend(i, q, k, v):
            return plan.attend(i, q, k, v, kv_caches[i], layers[i].self_attn.scale)

        return self.span(0, len(layers), input_ids, positions, None, attend)

    def span(self, lo: int, hi: int, input_ids: torch.Tensor, positions: torch.Tensor,
             residual: torch.Tensor | None, attend: Callable | None = None,
             attn_in: torch.Tensor | None = None, q_out: torch.Tensor | None = None,
             kv_of: Callable | None = None) -> torch.Tensor | None:  # fmt: skip
        """The one layer loop, of the eager forward and of the piecewise and whole-step CUDA
        graphs: layers [lo, hi) over the residual stream [T, hidden], updated in place (None
        with lo = 0: the embeddings become it), each as pre-attention -> ``attend(i, q, k, v)``
        -> post-attention. A span from lo = 0 embeds ``input_ids``; a later one starts with
        layer lo - 1's post-attention of ``attn_in`` [T, Hq, D] (attended between two spans).
        Then the final norm (hi = L: returned) or layer hi's pre-attention: its q into
        ``q_out``, its K/V into the cache, None returned. Pieces of no layer (lo = hi) are the
        piecewise graphs'. kv_of(i) -> (kv_cache, slot_mapping): every layer's K/V stored by
        its RoPE launch (``Attention.qkv``), so ``attend`` gets k = v = None (needed where
        hi < L; without it ``attend`` stores them)."""
        layers = self.layers
        x = None
        if lo == 0:
            embeddings = self.embed_tokens(input_ids)
            if residual is None:
                residual = embeddings
            else:
                residual.copy_(embeddings)
        else:
            x = layers[lo - 1].post_attention(attn_in, residual)
        for i in range(lo, hi):
            kv = None if kv_of is None else kv_of(i)
            q, k, v = layers[i].pre_attention(x, residual, positions, self.rotary, None, kv)
            if kv is not None:
                k = v = None  # already in the cache
            x = layers[i].post_attention(attend(i, q, k, v), residual)
        if hi == len(layers):
            return self.norm(x, residual)
        layers[hi].pre_attention(x, residual, positions, self.rotary, q_out, kv_of(hi))
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> float32 logits [N, vocab] (full vocab on every rank)."""
        return self.lm_head.logits(hidden).float()

    def sampling_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [N, hidden] -> (logits [N, vocab], their argmax int64 [N]) for a step that
        samples. On a GPU the logits stay in the model's dtype: the sampling kernels
        (``kernels/top_k_top_p.py``) load them as float32, the float32 copy's values exactly,
        and the argmax is ``greedy_tokens``'; without the [N, vocab] float32 copy and torch's
        row-a-block argmax (42 and 35 us a forward of sampled ``aspire`` on Qwen2.5 at 64
        rows, H100: the profile in docs/bench_diag_h100_qwen05b_32k_t07p09_s35_atstart.json).
        Elsewhere ``compute_logits``' float32 and its argmax."""
        logits = self.lm_head.logits(hidden)
        if not fused_ops(logits):
            logits = logits.float()
        return logits, _argmax(logits)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> int64 [N], the logits' argmax taken in the model's dtype: its
        float32 copy orders every value (and tie) the same, so the tokens are those of
        ``compute_logits(hidden).argmax(-1)``, without the [N, vocab] float32 copy (~28 us a
        64-row step at Qwen2.5's 152k vocabulary on an H200). On a GPU the argmax is
        ``kernels.argmax`` (two launches over every SM; torch's reduction keeps a row a block)."""
        return _argmax(self.lm_head.logits(hidden))

    def load_weights(self, weights) -> set[str]:
        """Load (hf_name, full tensor) pairs; returns the names of parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            shard_id = None
            for hf_part, (ours, sid) in self.STACKED.items():
                if f".{hf_part}." in name:
                    name, shard_id = name.replace(hf_part, ours), sid
                    break
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no matching parameter")
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            tensor = tensor.to(param.dtype)
            if loader is None:
                param.data.copy_(tensor)
            else:
                loader(param, tensor, shard_id)
            loaded.add(name)
            if name == "embed_tokens.weight" and self.arch.tie_word_embeddings:
                self.lm_head.load_shard(self.lm_head.weight, tensor)
                loaded.add("lm_head.weight")
        return loaded
