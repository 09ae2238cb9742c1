"""The device-resident page table: the device copy follows the host one through updates,
truncations, growth and slot reuse, and ragged gathers list exactly the host pages."""

from __future__ import annotations

import numpy as np
import torch

from aspire_ray.worker.page_table import PageTable, ragged_rows


def _lists(table: PageTable) -> dict[int, list[int]]:
    live = set(range(table.slots)) - set(table.free)
    return {s: table.table[s, : table.sizes[s]].tolist() for s in sorted(live)}


def test_device_table_follows_updates_growth_and_reuse():
    rng = np.random.default_rng(0)
    table = PageTable(torch.device("cpu"), width=2, slots=1)
    model: dict[int, list[int]] = {}
    for step in range(200):
        op = rng.integers(0, 4)
        if op == 0 or not model:
            model[table.acquire()] = []
        elif op == 1 and len(model) > 1:
            slot = int(rng.choice(list(model)))
            table.release(slot)
            del model[slot]
        else:
            slot = int(rng.choice(list(model)))
            keep = int(rng.integers(0, len(model[slot]) + 2))
            new = rng.integers(0, 10_000, int(rng.integers(0, 40))).tolist()
            table.update(slot, keep, new)
            model[slot] = model[slot][:keep] + new
        if step % 3 == 0:  # several updates may wait for one flush
            table.flush()
            assert _lists(table) == model
            assert all(table.host[s, : len(p)].tolist() == p for s, p in model.items())
    assert table.slots > 1 and table.width > 2


def test_ragged_rows_enumerates_each_row():
    counts = torch.tensor([3, 0, 1, 4], dtype=torch.int32)
    row, j = ragged_rows(counts, 8)
    assert row.tolist() == [0, 0, 0, 2, 3, 3, 3, 3]
    assert j.tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
