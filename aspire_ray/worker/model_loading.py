"""Build a DecoderModel shard and fill its weights (HF safetensors, GGUF-derived, or dummy)."""

from __future__ import annotations

import contextlib
import hashlib

import torch

from aspire_ray.config import EngineConfig
from aspire_ray.model import loader, registry
from aspire_ray.model.arch import ModelArch
from aspire_ray.model.decoder import DecoderModel
from aspire_ray.tp import TPGroup

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_hf_config(cfg: EngineConfig):
    """The transformers config of the engine's model (alias, GGUF, directory or dict)."""
    if cfg.load_format == "dummy" and cfg.model == "dummy":
        from transformers import AutoConfig

        overrides = dict(cfg.hf_overrides)
        model_type = overrides.pop("model_type")
        return AutoConfig.for_model(model_type, **overrides)
    source = registry.resolve(cfg.model, "auto" if cfg.load_format == "dummy" else cfg.load_format)
    return loader.load_hf_config(source.hf_dir, cfg.hf_overrides)


def hf_weight_shapes(arch: ModelArch) -> list[tuple[str, tuple[int, ...]]]:
    """Names and full (unsharded) shapes of a HF checkpoint of this architecture."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv, inter = arch.num_heads * d, arch.num_kv_heads * d, arch.intermediate_size
    shapes = [("model.embed_tokens.weight", (arch.vocab_size, h)), ("model.norm.weight", (h,))]
    if not arch.tie_word_embeddings:
        shapes.append(("lm_head.weight", (arch.vocab_size, h)))
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if arch.qkv_bias:
            shapes += [(p + f"self_attn.{x}_proj.bias", (n,)) for x, n in (("q", q), ("k", kv),
                                                                            ("v", kv))]
        if arch.qk_norm:
            shapes += [(p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,))]
    return shapes


def dummy_weights(arch: ModelArch, seed: int, device: torch.device, dtype: torch.dtype):
    """Deterministic random weights per tensor name (identical on every TP rank)."""
    for name, shape in hf_weight_shapes(arch):
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        gen = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:7], "little"))
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        else:
            t = 0.02 * torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
        yield name, t.to(dtype)


def build_model(cfg: EngineConfig, tp: TPGroup, device: torch.device) -> DecoderModel:
    hf_config = load_hf_config(cfg)
    arch = ModelArch.from_hf_config(hf_config)
    dtype = DTYPES[cfg.dtype]
    with _default_dtype(dtype), torch.device(device):
        model = DecoderModel(arch, tp)
    if cfg.load_format == "dummy":
        weights = dummy_weights(arch, cfg.seed, device, dtype)
    else:
        source = registry.resolve(cfg.model, cfg.load_format)
        weights = loader.iter_safetensors(source.hf_dir)
    loaded = model.load_weights(weights)
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint of {cfg.model!r} lacks weights: {sorted(missing)[:5]}")
    return model.eval()
