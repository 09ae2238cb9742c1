"""A GGUF file -> a cached HF directory (safetensors + tokenizer), converted once per node.

GGUF files are dequantized once by transformers (~13 s for SmolLM2 on 2 cores) and cached as a
HF directory under ``$ASPIRE_RAY_CACHE`` (default ``~/.cache/aspire_ray``); later loads take
well under a second. An entry is built under a lock and published by one rename (``cache.py``),
so processes sharing a node never see or remove a half-built entry. An alias may add the stop
tokens of its upstream generation config, written into the entry's ``generation_config.json``.
Torch-free to import (the conversion imports torch and transformers when it runs).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from aspire_ray.model.cache import cache_root, entry_lock, fsync_path, temp_prefix


def as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]



def conversion_entry(gguf_path: Path, stop_token_ids: tuple[int, ...]) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    if stop_token_ids:
        key += f"|stops={list(stop_token_ids)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def gguf_to_hf_dir(gguf_path: Path, stop_token_ids: tuple[int, ...] = ()) -> Path:
    """The cached HF directory of a GGUF file, converted once across processes.

    A complete entry (``done.json`` inside) is never removed or rewritten. Conversion runs under
    the entry's lock into a temporary directory beside it, renamed into place when complete.
    """
    target = conversion_entry(gguf_path, stop_token_ids)
    if (target / "done.json").is_file():
        return target
    with entry_lock(target):
        if (target / "done.json").is_file():  # another process converted it while we waited
            return target
        # Under the lock nobody else builds this entry: what is there is a crashed build's.
        for stale in target.parent.glob(temp_prefix(target) + "*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=temp_prefix(target)))
        try:
            convert_gguf(gguf_path, tmp)
            if stop_token_ids:
                add_generation_stops(tmp, stop_token_ids)
            (tmp / "done.json").write_text(json.dumps({"source": str(gguf_path)}))
            for file in tmp.iterdir():
                fsync_path(file)
            tmp.chmod(0o755)  # mkdtemp makes it private
            tmp.rename(target)
            fsync_path(target.parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF file with transformers and save it to ``out_dir`` as safetensors plus
    tokenizer (and chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    # The dequantized model is plain fp32: drop the quantizer so save_pretrained works.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))


def add_generation_stops(hf_dir: Path, stop_token_ids: tuple[int, ...]) -> None:
    path = hf_dir / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    eos = as_ids(gen.get("eos_token_id"))
    gen["eos_token_id"] = eos + [t for t in stop_token_ids if t not in eos]
    path.write_text(json.dumps(gen, indent=2) + "\n")
