"""Decode-row work lists planned on the device, at fixed capacities (CUDA-graph draft steps).

``paged_attention._host_plan`` and ``page_scores._host_work`` plan a step's work from host
copies of its metadata. A draft step of a chain has page lists that only the device knows
(their lengths follow the positions, which move on the device from step to step), so this
module computes the same work lists from the device metadata with fixed-shape tensor ops: no
host copies, no device sync, capturable in a CUDA graph. Rows hold one query each (decode and
draft rows), gamma + 1 each (a round's verify rows) or ragged counts (an asynchronous run's
mixed step: ``attention_items``); rows listing no page (a bucket's padding) get no work.

Meaning: for such rows, the items equal ``_host_plan``'s item for item, so the attention's
split and merge order, and with it every bit of its output, is the host plan's
(``tests/kernels/test_device_plan.py``). Pure torch: imports without triton.
"""

from __future__ import annotations

import math

import torch

from .attention_config import FIT_SPLITS, AttentionConfig, wave_fit_cost


def ragged_fixed(counts: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:  # fmt: skip
    """int64 [R] counts -> (row, local), int64 [capacity] each, and the total, int64 [1]:
    entry e < total is the local-th entry of row ``row``; entries past the total are row R - 1
    with a local index past its count (callers mask them with ``e < total``)."""
    ends = torch.cumsum(counts, 0)
    e = torch.arange(capacity, device=counts.device)
    row = torch.searchsorted(ends, e, right=True).clamp_(max=counts.shape[0] - 1)
    return row, e - (ends - counts)[row], ends[-1:]


_Items = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def decode_attention_items(kv_indptr: torch.Tensor, last_len: torch.Tensor, page_size: int,
                           group: int, hkv: int, cfg: AttentionConfig, num_sms: int,
                           capacity: int, q: int = 1) -> _Items:  # fmt: skip
    """Attention work of rows of ``q`` queries each (one: decode and draft rows; gamma + 1:
    the verify rows of a synchronized round), as ``_host_plan`` splits them.

    kv_indptr: int [R + 1]; last_len: int [R] -> (items int64 [6, capacity] with their count
    int64 [1]; merge entries int64 [4, R * q] with their count int64 [1]). Columns as the
    kernels read them: items (row, first query, KV token range lo / hi, split or -1, first
    partial row); merge entries (output token, splits, first partial row, partial stride q).
    Row r's queries are tokens r * q .. r * q + q - 1 (padding rows included).
    """
    r = kv_indptr.shape[0] - 1
    n_q = torch.full((r,), q, dtype=torch.long, device=kv_indptr.device)
    bm = _block_m(q, group, cfg)
    (items, count), merge = attention_items(kv_indptr, last_len, n_q, page_size, group, hkv,
                                            cfg, num_sms, [bm], capacity, r * q,
                                            uniform_q=q)  # fmt: skip
    return items, count, *merge


def attention_items(kv_indptr: torch.Tensor, last_len: torch.Tensor, n_q: torch.Tensor,
                    page_size: int, group: int, hkv: int, cfg: AttentionConfig, num_sms: int,
                    block_ms: list[int], capacity: int, merge_capacity: int,
                    wide_tiles: bool = False,
                    uniform_q: int | None = None) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Attention work of rows of ``n_q`` queries each (int64 [R]; a step mixing draft rows of
    one query and verify rows of d + 1), as ``_host_plan`` splits them: one launch per query
    tile in ``block_ms`` (the tiles any row may need; a row's tile is ``_block_m`` of its
    queries), rows in order within a launch.

    -> per block_m, (items int64 [6, capacity], count int64 [1]), then (merge entries int64
    [4, merge_capacity], count int64 [1]). Row r's queries are the tokens from
    ``cumsum(n_q)[r - 1]``; rows listing no page get no work (and should hold no query).
    wide_tiles: every row of several queries takes the widest tile of ``block_ms`` (one launch
    for all of a mixed step's verify rows: a launch of a few rows leaves most SMs idle), and
    with ``cfg.mixed_one_launch`` so does every other row of a step that holds one; rows of
    one query in a step of such rows only keep theirs. uniform_q: every row (but padding)
    holds this many queries.
    """
    n_pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    kv_len = (n_pages - 1) * page_size + last_len.long()
    qo_start = torch.cumsum(n_q, 0) - n_q
    if uniform_q is not None:  # one tile for all: no per-row tile arithmetic
        row_bm = torch.full_like(n_q, _block_m(uniform_q, group, cfg))
    elif wide_tiles:
        wide = n_q > 1
        if cfg.mixed_one_launch:
            wide = wide | wide.any()
        row_bm = torch.where(wide, max(block_ms), _block_m(1, group, cfg))
    else:
        row_bm = _next_power_of_2(n_q * group).clamp(cfg.block_m_min, cfg.block_m_max)
    tokens = row_bm // group  # query tokens per tile
    blocks = -(-n_q // tokens)  # query tiles per row
    if cfg.kv_chunk_pages is not None:
        chunk = torch.full_like(n_pages[:1], cfg.kv_chunk_pages)
    elif cfg.resident_programs is not None:
        chunk = _fit_chunk(n_pages, blocks, n_q <= cfg.split_max_q, hkv, cfg, num_sms)
    else:  # the host's float64 math.ceil(total * hkv / target)
        target = cfg.waves * num_sms
        total = (n_pages * blocks).sum().reshape(1)
        chunk = torch.ceil((total * hkv).double() / target).long().clamp_(min=cfg.min_chunk_pages)
    live = n_pages > 0
    splits = torch.where(n_q <= cfg.split_max_q, (n_pages + chunk - 1) // chunk, live.long())
    splits = torch.where(live, splits.clamp(min=1), 0)
    per = (n_pages + splits - 1) // splits.clamp(min=1)  # pages per chunk, balanced
    if not cfg.balanced_chunks:  # cut at multiples of the chunk
        per = torch.where(splits > 1, chunk, per)
    splits = torch.where(live, (n_pages + per - 1) // per.clamp(min=1), 0)
    split_rows = splits > 1
    part_rows = torch.where(split_rows, splits * n_q, 0)
    part_base = torch.where(split_rows, torch.cumsum(part_rows, 0) - part_rows, 0)

    out = []
    for bm in block_ms:  # items: for each row, for each query tile b, for each chunk s
        per_row = splits * blocks  # one launch: every row's; else the rows of this tile
        if len(block_ms) > 1:
            per_row = torch.where(row_bm == bm, per_row, 0)
        row, local, count = ragged_fixed(per_row, capacity)
        n_split = splits[row].clamp(min=1)
        s = local % n_split
        is_split = split_rows[row]
        lo = torch.where(is_split, s * per[row] * page_size, 0)
        hi = torch.where(is_split, torch.minimum((s + 1) * per[row] * page_size, kv_len[row]),
                         kv_len[row])  # fmt: skip
        out.append((torch.stack([row, local // n_split * tokens[row], lo, hi,
                                 torch.where(is_split, s, -1), part_base[row]]), count))
    # merge entries: each split row's queries, split rows in row order
    row, t, count = ragged_fixed(torch.where(split_rows, n_q, 0), merge_capacity)
    merge = torch.stack([qo_start[row] + t, splits[row], part_base[row] + t, n_q[row]])
    out.append((merge, count))
    return tuple(out)


def _fit_chunk(n_pages: torch.Tensor, blocks: torch.Tensor, splittable: torch.Tensor, hkv: int,
               cfg: AttentionConfig, num_sms: int) -> torch.Tensor:  # fmt: skip
    """``paged_attention._fit_chunk`` on the device: int64 [1], no sync."""
    n_max = torch.where(splittable, n_pages, 0).amax().reshape(1)
    k = torch.arange(1, FIT_SPLITS + 1, device=n_pages.device)
    chunks = ((n_max + k - 1) // k).clamp_(min=cfg.min_chunk_pages)  # [K]
    splits = torch.where(splittable, (n_pages + chunks[:, None] - 1) // chunks[:, None], 1)
    items = (torch.where(n_pages > 0, splits, 0) * blocks).sum(1)  # [K]
    slots = cfg.resident_programs * num_sms
    cost = wave_fit_cost(chunks, items, hkv, slots, cfg.ramp_pages)
    spread = math.ceil(cfg.waves * num_sms / hkv)
    cost = torch.where(items <= spread + items[:1], cost, torch.iinfo(torch.int64).max)
    return chunks[torch.argmin(cost)].reshape(1)  # the first minimum: the longest chunk


def _next_power_of_2(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= each entry of int64 x (1 for x <= 1), in integer ops."""
    v = (x - 1).clamp(min=0)
    for shift in (1, 2, 4, 8, 16, 32):
        v = v | (v >> shift)
    return v + 1


def _block_m(q: int, group: int, cfg: AttentionConfig) -> int:
    """``paged_attention._block_m`` of one row of q queries."""
    big = 1 << max(q * group - 1, 0).bit_length()  # next power of two
    return min(max(big, cfg.block_m_min), cfg.block_m_max)


def score_items(kv_indptr: torch.Tensor, page_size: int, block_n: int,
                capacity: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The page-scoring kernel's work (``page_scores._host_work``): int64 [2, capacity]
    (row, first token) per program of ``block_n`` listed tokens, and the count, int64 [1]."""
    tokens = (kv_indptr[1:] - kv_indptr[:-1]).long() * page_size
    row, local, count = ragged_fixed((tokens + block_n - 1) // block_n, capacity)
    return torch.stack([row, local * block_n]), count
