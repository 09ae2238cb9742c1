"""The live requests' block tables, resident on the device (DESIGN.md §1.1, issue 14 item 1).

A request's physical page ids are one row (its slot) of an int32 [slots, width] table, kept
twice: a host mirror (numpy) for the few per-token lookups of planning (KV slots of the step's
tokens), and a device copy from which every page list of a step is gathered. A step changes
few entries (a decode row adds at most a page), so the device copy is updated from that delta
(``flush``); page lists of any length are then built on the device from O(rows) host numbers
(``ragged_rows`` + an index), never as host arrays of every listed page: at 64 requests x 32k
tokens those were 128k-entry arrays per list per step, most of a step's host planning.

One slot per live request, also the request's row of the page-score table (``draft_pages``).
"""

from __future__ import annotations

import numpy as np
import torch

from aspire_ray.kernels.host import ragged_arange, upload
from aspire_ray.kernels.reference import gather_lists_ref
from aspire_ray.model.rotary import fused_ops


class PageTable:
    def __init__(self, device: torch.device, width: int = 64, slots: int = 16) -> None:
        self.device = device
        self.host = np.zeros((slots, width), dtype=np.int32)
        self.table = torch.zeros(slots, width, dtype=torch.int32, device=device)
        self.sizes = np.zeros(slots, dtype=np.int64)  # pages held by each slot
        self.free = list(range(slots - 1, -1, -1))
        self._pending: list[tuple[int, int, int]] = []  # (slot, lo, hi) written on the host only

    @property
    def slots(self) -> int:
        return self.host.shape[0]

    @property
    def width(self) -> int:
        return self.host.shape[1]

    def acquire(self) -> int:
        if not self.free:
            old = self.slots
            self._resize(2 * old, self.width)
            self.free = list(range(2 * old - 1, old - 1, -1))
        return self.free.pop()

    def release(self, slot: int) -> None:
        self.sizes[slot] = 0
        self.free.append(slot)

    def update(self, slot: int, keep: int, new: list[int]) -> None:
        """Truncate the slot's list to ``keep`` pages, then append ``new`` (host now, device at
        the next ``flush``)."""
        keep = min(keep, int(self.sizes[slot]))
        size = keep + len(new)
        if size > self.width:
            self._resize(self.slots, max(size, 2 * self.width))
        if new:
            self.host[slot, keep:size] = new
            self._pending.append((slot, keep, size))
        self.sizes[slot] = size

    def flush(self) -> None:
        """Copy the entries written since the last flush to the device: one upload of
        int32 [2, k] (flat index, page id) and one scatter; no device sync."""
        if not self._pending:
            return
        slot, lo, hi = (np.array(x, dtype=np.int64) for x in zip(*self._pending, strict=True))
        self._pending.clear()
        flat = np.repeat(slot * self.width + lo, hi - lo) + ragged_arange(hi - lo)
        delta = upload(np.stack([flat, self.host.reshape(-1)[flat]]).astype(np.int32), self.device)
        self.table.view(-1)[delta[0].long()] = delta[1]

    def _resize(self, slots: int, width: int) -> None:
        host = np.zeros((slots, width), dtype=np.int32)
        host[: self.slots, : self.width] = self.host
        table = torch.zeros(slots, width, dtype=torch.int32, device=self.device)
        table[: self.slots, : self.width] = self.table
        self.sizes = np.concatenate([self.sizes, np.zeros(slots - self.slots, dtype=np.int64)])
        self.host, self.table = host, table


def ragged_rows(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Device int [R] counts (sum ``total``, known on the host) -> int64 (row, j), each
    [total]: entry e is the j-th entry of row ``row``. No device sync (``output_size``)."""
    counts = counts.long()
    rows = torch.arange(counts.shape[0], device=counts.device)
    row = torch.repeat_interleave(rows, counts, output_size=total)
    starts = torch.cumsum(counts, 0) - counts
    return row, torch.arange(total, device=counts.device) - starts[row]


def gather_lists(table: torch.Tensor, counts: torch.Tensor, logical: torch.Tensor,
                 row_slot: torch.Tensor, capacity: int) -> tuple[torch.Tensor,
                                                                 torch.Tensor]:  # fmt: skip
    """Row r lists the pages logical[r, :counts[r]] of page-table row row_slot[r] (table: int32
    [slots, W]) -> (kv_indptr int32 [R + 1], kv_indices int32 [capacity]; 0 past
    kv_indptr[R]). Fixed shapes: capturable. On a GPU one Triton launch
    (``kernels/list_gather.py``); the meaning is ``reference.gather_lists_ref``."""
    if fused_ops(table):
        from aspire_ray.kernels.list_gather import gather_lists as kernel

        return kernel(table, counts, logical, row_slot, capacity)
    return gather_lists_ref(table, counts, logical, row_slot, capacity)


def list_capacity(rows: int, table: torch.Tensor, pool_pages: int) -> int:
    """Most pages the page lists of ``rows`` rows may hold in all: a row lists at most the
    page table's width (table: int32 [slots, W]) and rows never share a page. A fixed
    capacity for CUDA graphs (the tables' shapes key their capture)."""
    return min(rows * table.shape[1], pool_pages)
