"""Greedy tokens from the logits in the model's dtype equal the argmax of their float32 copy
(the CUDA-graph paths skip the [N, vocab] float32 copy)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS
from transformers import AutoConfig

from aspire_ray.model.arch import ModelArch
from aspire_ray.model.decoder import DecoderModel
from aspire_ray.tp import TPGroup


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_tokens_equal_float32_argmax(dtype):
    cfg = dict(TINY_CONFIGS["llama"])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = DecoderModel(ModelArch.from_hf_config(config), TPGroup()).to(dtype)
    w = model.lm_head.weight
    with torch.no_grad():
        w.normal_(0.0, 1.0)
        w[200:].copy_(w[100:156])  # exact ties: the lower index wins in both dtypes
        w[7].copy_(w[3])
    hidden = torch.randn(512, config.hidden_size).to(dtype)
    hidden[:8] = w[3].detach()  # rows whose maximum is the tie between tokens 3 and 7
    got = model.greedy_tokens(hidden)
    want = model.compute_logits(hidden).argmax(dim=-1)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert (got[:8] == 3).all()
    assert bool(((got >= 200) | (got == 7)).logical_not().all())  # no tie resolved upward
