"""Resident memory sampling (aspire_ray/process_memory.py, executor/shard_memory.py): the engine
asks after every step, so its own process is read at most once an interval, and the shard
actors are asked at most once an interval, never waited for, a dead one left out."""

from __future__ import annotations

import mmap
import time

import psutil
import pytest
from helpers import local_ray

from aspire_ray.executor.shard_memory import ShardMemory
from aspire_ray.process_memory import ResidentMemory

ray = pytest.importorskip("ray")


def test_own_rss_is_read_again_only_after_the_interval():
    memory = ResidentMemory(interval_s=3600)
    first = memory.bytes()
    assert first == pytest.approx(psutil.Process().memory_info().rss, rel=0.25)
    # 64 MiB more resident: a fresh anonymous mapping, every page written (a zero-filled
    # bytearray's fresh pages are not resident until touched; and a 64 MiB bytes object can be
    # carved from a free chunk of the heap whose pages are resident already: after
    # test_smollm2.py in the same process, RSS did not move)
    size = 64 * 2**20
    grown = mmap.mmap(-1, size)
    for at in range(0, size, mmap.PAGESIZE):
        grown[at] = 1
    assert memory.bytes() == first  # within the interval: the last reading
    fresh = ResidentMemory(interval_s=0).bytes()
    assert fresh - first > 32 * 2**20
    grown.close()


def _sampled_until(memory: ShardMemory, done, timeout: float = 30.0) -> dict:
    """The first sample for which ``done(sample)`` holds (asking on; {} after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not done(sample := memory.sample()):
        if time.monotonic() > deadline:
            return {}
        time.sleep(0.02)
    return sample


def test_shards_are_asked_once_an_interval_and_never_waited_for():
    @ray.remote(num_cpus=0)  # defined here: Ray workers cannot import a test module
    class CountingShard:
        """A stand-in shard actor: counts the RSS calls it answers, each after 0.3 s; its
        n-th answer is 100 * n."""

        def __init__(self) -> None:
            self.asks = 0

        def resident_memory(self) -> int:
            self.asks += 1
            time.sleep(0.3)
            return 100 * self.asks

        def asked(self) -> int:
            return self.asks

    with local_ray(num_cpus=2):
        actors = [CountingShard.remote() for _ in range(2)]
        assert ray.get([a.asked.remote() for a in actors]) == [0, 0]  # both started
        memory = ShardMemory(actors, interval_s=3600)
        assert memory.sample() == {}  # asked; the answers take 0.3 s: not waited for
        first = {"shard0": 100, "shard1": 100}
        assert _sampled_until(memory, lambda s: s == first) == first
        for _ in range(100):  # a step's worth of asks within the interval: none reaches a rank
            assert memory.sample() == first
        assert ray.get([a.asked.remote() for a in actors]) == [1, 1]
        memory.interval_s = 0.0  # the interval is over: the next sample asks again
        second = {"shard0": 200, "shard1": 200}
        assert _sampled_until(memory, lambda s: s != first) == second
        ray.kill(actors[1])
        assert set(_sampled_until(memory, lambda s: "shard1" not in s)) == {"shard0"}
