"""Model architecture read from a transformers config (Llama, Qwen2, Qwen3 families)."""

from __future__ import annotations

from dataclasses import dataclass

# HF model_type -> (qkv bias, per-head q/k RMSNorm)
_FAMILIES = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}


@dataclass(frozen=True)
class ModelArch:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @staticmethod
    def from_hf_config(cfg) -> ModelArch:
        model_type = getattr(cfg, "model_type", None)
        if model_type not in _FAMILIES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {sorted(_FAMILIES)}"
            )
        qkv_bias, qk_norm = _FAMILIES[model_type]
        qkv_bias = bool(getattr(cfg, "attention_bias", qkv_bias)) or qkv_bias
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        eos = getattr(cfg, "eos_token_id", None)
        if isinstance(eos, list | tuple):
            eos_ids = tuple(eos)
        else:
            eos_ids = (eos,) if eos is not None else ()
        rope_scaling = getattr(cfg, "rope_scaling", None)
        rope_theta = getattr(cfg, "rope_theta", None)
        rope_params = getattr(cfg, "rope_parameters", None)  # transformers >= 5
        if rope_params:
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        return ModelArch(
            model_type=model_type,
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            eos_token_ids=eos_ids,
        )
