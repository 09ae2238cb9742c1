"""The graphs' stores made after the KV pool (``worker/device_memory.py``): whether one fits,
and the one allocation that every row bucket views."""

import pytest
import torch

from aspire_ray.tp.group import single_rank
from aspire_ray.worker import device_memory
from aspire_ray.worker.device_memory import RowStore


def test_a_row_store_is_one_allocation_viewed_by_every_bucket():
    store = RowStore(planes=3, rows=8, vocab=5, device=torch.device("cpu"), tp=single_rank(),
                     copies=2)
    assert store.data is None and store.nbytes == 2 * 3 * 8 * 5 * 4  # nothing made yet
    small, large = store.view(2), store.view(8)
    assert small.shape == (3, 2, 5) and large.shape == (3, 8, 5)
    small[1, 1, 4] = 7.0  # a bucket's row r is every larger bucket's row r
    assert large[1, 1, 4] == 7.0 and store.view(8, copy=1)[1, 1, 4] == 0.0  # copies apart
    assert len(store.data) == 2 and store.fits()
    with pytest.raises(ValueError, match="past the store"):
        store.view(9)


def test_a_row_store_fits_only_with_room_to_spare(monkeypatch):
    store = RowStore(planes=2, rows=4, vocab=3, device=torch.device("cpu"), tp=single_rank())
    room = store.nbytes + device_memory.SPARE_BYTES
    monkeypatch.setattr(device_memory, "free_device_bytes", lambda device: room)
    assert store.fits()
    monkeypatch.setattr(device_memory, "free_device_bytes", lambda device: room - 1)
    assert not store.fits()
    store.view(4)  # once made, it fits whatever is free
    assert store.fits()
