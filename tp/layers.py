"""Megatron-style parallel layers. Each parameter carries ``weight_loader(param, full_weight,
shard_id)`` which cuts this rank's shard from a full checkpoint tensor, so the checkpoint loader
knows nothing about sharding.

Column-parallel layers split the output features (no communication); row-parallel layers split
the input features and all-reduce the output; vocab-parallel embedding/head split the vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .group import TPGroup


def _narrow(w: torch.Tensor, dim: int, index: int, size: int) -> torch.Tensor:
    return w.narrow(dim, index * size, size)


def invariant_linear(x: torch.Tensor, w: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``F.linear`` whose each row is computed the same way, bit for bit, whatever the other
    rows and their number (the deterministic mode, issue 18): x [..., K], w [N, K] -> [..., N].

    cuBLAS and the CPU's BLAS pick kernels by the row count (on the CPU a 1-3 row GEMM rounds
    otherwise than a 4-row one). On a GPU: ``kernels.linear`` with one tiling for every row
    count (``invariant_config``, chosen by the weight's shape); elsewhere a batched product of
    one-row GEMMs ([T, 1, K] @ [K, N] each), whose per-row kernel does not change with T."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if x.is_cuda:
        from aspire_ray.kernels.linear import invariant_config, triton_linear

        y = triton_linear(rows.contiguous(), w, bias, invariant_config(*w.shape))
    else:
        y = torch.bmm(rows.unsqueeze(1), w.t().expand(rows.shape[0], k, w.shape[0])).squeeze(1)
        if bias is not None:
            y = y + bias
    return y.reshape(*x.shape[:-1], w.shape[0])


def set_batch_invariant(model: nn.Module, on: bool = True) -> None:
    """Every linear layer and the LM head of ``model`` through ``invariant_linear`` (on) or
    ``F.linear`` (off)."""
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            m.invariant = on


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by output rows: [out/tp, in] on each rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        if out_features % tp.size:
            raise ValueError(f"output size {out_features} not divisible by tp_size={tp.size}")
        self.tp = tp
        self.out_local = out_features // tp.size
        self.weight = nn.Parameter(torch.empty(self.out_local, in_features), requires_grad=False)
        self.weight.weight_loader = self.load_shard
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_local), requires_grad=False)
            self.bias.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(_narrow(full, 0, self.tp.rank, self.out_local))

    invariant = False  # set_batch_invariant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (invariant_linear if self.invariant else F.linear)(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused (gate and up): each part split separately."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, sum(part_sizes), bias, tp)
        self.part_local = [s // tp.size for s in part_sizes]

    def load_shard(self, param: nn.Parameter, full: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.part_local[:shard_id])
        size = self.part_local[shard_id]
        param.data.narrow(0, offset, size).copy_(_narrow(full, 0, self.tp.rank, size))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; kv heads are replicated when kv_heads < tp_size."""

    def __init__(self, hidden: int, head_dim: int, q_heads_local: int, kv_heads_local: int,
                 kv_head_start: int, bias: bool, tp: TPGroup) -> None:
        nn.Module.__init__(self)
        self.tp = tp
        self.head_dim = head_dim
        self.q_local = q_heads_local * head_dim
        self.kv_local = kv_heads_local * head_dim
        self.kv_start = kv_head_start * head_dim
        self.out_local = self.q_local + 2 * self.kv_local
        self.weight = nn.Parameter(torch.empty(self.out_local, hidden), requires_grad=False)
        self.weight.weight_loader = self.load_shard
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_local), requires_grad=False)
            self.bias.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, full: torch.Tensor, shard_id: str) -> None:
        if shard_id == "q":
            dst = param.data.narrow(0, 0, self.q_local)
            src = _narrow(full, 0, self.tp.rank, self.q_local)
        else:
            offset = self.q_local + (0 if shard_id == "k" else self.kv_local)
            dst = param.data.narrow(0, offset, self.kv_local)
            src = full.narrow(0, self.kv_start, self.kv_local)
        dst.copy_(src)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_shard W_shard^T) + b, W split by input columns: [out, in/tp]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        if in_features % tp.size:
            raise ValueError(f"input size {in_features} not divisible by tp_size={tp.size}")
        self.tp = tp
        self.in_local = in_features // tp.size
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local), requires_grad=False)
        self.weight.weight_loader = self.load_shard
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = lambda p, full, shard_id=None: p.data.copy_(full)

    def load_shard(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(_narrow(full, 1, self.tp.rank, self.in_local))

    invariant = False  # set_batch_invariant
    # steps of at most this many rows, bf16 / fp16 on a GPU, through kernels/linear.py, not
    # cuBLAS (0: never; model/decoder.set_triton_projections)
    triton_rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            y = invariant_linear(x, self.weight)
        elif self.triton_rows and _triton_fits(x, self.triton_rows):
            from aspire_ray.kernels.linear import invariant_config, triton_linear

            y = triton_linear(x, self.weight, None, invariant_config(*self.weight.shape))
        else:
            y = F.linear(x, self.weight)
        y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y


def _triton_fits(x: torch.Tensor, max_rows: int) -> bool:
    """A decode-sized half-precision x [T, K] on a GPU (float32 keeps cuBLAS: the fp32 runs
    that check exactness compare steps of every size, and a Triton product is not cuBLAS's)."""
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= max_rows and x.stride(1) == 1
            and x.dtype in (torch.bfloat16, torch.float16))  # fmt: skip


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocab split in contiguous ranges; out-of-range ids give 0, summed."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_local = -(-vocab_size // tp.size)  # padded so every rank has the same rows
        self.vocab_start = tp.rank * self.vocab_local
        self.weight = nn.Parameter(torch.zeros(self.vocab_local, hidden), requires_grad=False)
        self.weight.weight_loader = self.load_shard

    def load_shard(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        rows = full[self.vocab_start : self.vocab_start + self.vocab_local]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        valid = (local >= 0) & (local < self.vocab_local)
        out = F.embedding(local.clamp(0, self.vocab_local - 1), self.weight)
        out = out * valid.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T over this rank's vocab slice, gathered to the full vocab on every rank."""

    invariant = False  # set_batch_invariant

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        local = (invariant_linear if self.invariant else F.linear)(h, self.weight)  # [T, V/tp]
        full = self.tp.all_gather(local, dim=-1)
        return full[:, : self.vocab_size]
