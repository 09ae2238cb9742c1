"""A model's config and weights, from the HF directory ``registry.resolve`` finds (random
weights, "dummy", at a given config, come from the worker).

Stop tokens: a HF directory's ``generation_config.json`` may list more than ``config.json``
(Llama 3 Instruct: 128001, 128008, 128009); ``load_hf_config`` merges them into
``eos_token_id``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from aspire_ray.model.cache import ModelNotFoundError
from aspire_ray.model.gguf_convert import as_ids

if TYPE_CHECKING:
    import torch


def generation_eos_ids(hf_dir: Path) -> list[int]:
    """The ``eos_token_id`` list of ``hf_dir/generation_config.json`` ([] if none)."""
    path = Path(hf_dir) / "generation_config.json"
    if not path.is_file():
        return []
    return as_ids(json.loads(path.read_text()).get("eos_token_id"))


def load_hf_config(hf_dir: Path, overrides: dict | None = None):
    """The transformers config, its ``eos_token_id`` joined with the generation config's stop
    tokens (config.json's first); ``overrides`` are applied last and win."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(hf_dir))
    eos = as_ids(getattr(config, "eos_token_id", None))
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
