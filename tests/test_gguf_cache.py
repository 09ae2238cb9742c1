"""The GGUF -> HF directory conversion cache is safe across processes (two replicas on one
node): converted once, published by one rename, a complete entry never removed.

transformers' conversion is replaced by a slow fake that writes files one by one, so a reader
polling the cache would see a half-written entry if one were ever published.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import time

import pytest

from aspire_ray.model import gguf_convert

FILES = [f"shard{i}.bin" for i in range(5)]
FILE_BYTES = 4096


def _slow_convert(gguf_path, out_dir) -> None:
    with open(os.environ["CONVERT_LOG"], "a") as log:
        log.write(f"{os.getpid()}\n")
    for name in FILES:
        (out_dir / name).write_bytes(b"x" * FILE_BYTES)
        time.sleep(0.05)


def _complete(entry) -> bool:
    return (entry / "done.json").is_file() and all(
        (entry / n).stat().st_size == FILE_BYTES for n in FILES)


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("ASPIRE_RAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CONVERT_LOG", str(tmp_path / "convert.log"))
    monkeypatch.setattr(gguf_convert, "convert_gguf", _slow_convert)
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF")
    return path


def _conversions(tmp_path) -> int:
    log = tmp_path / "convert.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def _convert_in_child(gguf, barrier, queue) -> None:
    barrier.wait()
    queue.put(str(gguf_convert.gguf_to_hf_dir(gguf)))


def _watch_entry(entry, stop, queue) -> None:
    """Poll the cache entry; report any moment it exists but is incomplete."""
    bad = 0
    while not stop.is_set():
        with contextlib.suppress(FileNotFoundError):  # a file vanishing = seen half-built
            if entry.exists() and not _complete(entry):
                bad += 1
        time.sleep(0.002)
    queue.put(bad)


def test_two_processes_convert_once_and_nobody_sees_half_an_entry(gguf, tmp_path):
    entry = gguf_convert.conversion_entry(gguf, ())
    ctx = multiprocessing.get_context("fork")
    barrier, queue, watch_q, stop = ctx.Barrier(2), ctx.Queue(), ctx.Queue(), ctx.Event()
    watcher = ctx.Process(target=_watch_entry, args=(entry, stop, watch_q))
    watcher.start()
    procs = [ctx.Process(target=_convert_in_child, args=(gguf, barrier, queue))
             for _ in range(2)]
    for p in procs:
        p.start()
    results = {queue.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    stop.set()
    assert watch_q.get(timeout=30) == 0
    watcher.join(timeout=30)
    assert results == {str(entry)}
    assert _complete(entry)
    assert _conversions(tmp_path) == 1
    assert not [p for p in os.listdir(entry.parent) if ".tmp-" in p]


def test_a_converter_that_waited_keeps_the_finished_entry(gguf, tmp_path, monkeypatch):
    """The race, step by step: this process found no entry, and while it waited for the lock
    another process published one. It must return that entry, not convert and replace it."""
    entry = gguf_convert.conversion_entry(gguf, ())
    real_lock = gguf_convert.entry_lock

    @contextlib.contextmanager
    def lock_while_other_process_publishes(path):
        with real_lock(path):
            other = entry.parent / ".other-process"
            other.mkdir()
            _slow_convert(gguf, other)
            (other / "done.json").write_text("{}")
            other.rename(entry)
            yield

    monkeypatch.setattr(gguf_convert, "entry_lock", lock_while_other_process_publishes)
    entry.parent.mkdir(parents=True)
    assert gguf_convert.gguf_to_hf_dir(gguf) == entry
    inode = (entry / "done.json").stat().st_ino
    assert _conversions(tmp_path) == 1  # the other process's only
    monkeypatch.setattr(gguf_convert, "entry_lock", real_lock)
    assert gguf_convert.gguf_to_hf_dir(gguf) == entry
    assert (entry / "done.json").stat().st_ino == inode
    assert _conversions(tmp_path) == 1


def test_a_crashed_build_is_replaced(gguf, tmp_path):
    entry = gguf_convert.conversion_entry(gguf, ())
    entry.mkdir(parents=True)  # an entry without done.json: nobody reads it
    (entry / "shard0.bin").write_bytes(b"half")
    stale = entry.parent / (gguf_convert.temp_prefix(entry) + "dead")
    stale.mkdir()
    assert gguf_convert.gguf_to_hf_dir(gguf) == entry
    assert _complete(entry) and not stale.exists()
    assert json.loads((entry / "done.json").read_text())["source"] == str(gguf)


def test_a_failed_conversion_leaves_nothing(gguf, monkeypatch):
    def broken(gguf_path, out_dir):
        (out_dir / "shard0.bin").write_bytes(b"x")
        raise RuntimeError("out of memory")

    monkeypatch.setattr(gguf_convert, "convert_gguf", broken)
    entry = gguf_convert.conversion_entry(gguf, ())
    with pytest.raises(RuntimeError, match="out of memory"):
        gguf_convert.gguf_to_hf_dir(gguf)
    assert [p for p in os.listdir(entry.parent) if not p.endswith(".lock")] == []


def test_alias_stop_tokens_get_their_own_entry(gguf):
    assert gguf_convert.conversion_entry(gguf, ()) != gguf_convert.conversion_entry(gguf, (7,))
