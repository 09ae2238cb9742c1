"""Issue 18 on the real models: with ``deterministic`` on, bf16 greedy output of every
speculative mode equals `ar`'s token for token, 64 requests x 256 new tokens over real long
text (windows of scripts/workloads.py's document), on SmolLM2-135M and Qwen2.5-Coder-0.5B.

GPU only, and only where the models are: an alias that resolves (its PyPI parts installed) or
a .gguf file in ``ASPIRE_REAL_MODELS_DIR`` (an offline GPU host: scripts/gpu_runs.sh stages
them in /tmp/models). Otherwise skipped, never faked.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import scripts_imported

from aspire_ray import LLM, SamplingParams
from aspire_ray.config import SPEC_MODES
from aspire_ray.model.cache import ModelNotFoundError
from aspire_ray.model.registry import resolve_alias

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# alias, its file name, prompt tokens (rows over several 64-page KV chunks; SmolLM2's context
# is 8,192 positions)
MODELS = [("smollm2-135m-instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", 7_600),
          ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 16_000)]


def _model_path(alias: str, filename: str) -> str:
    staged = Path(os.environ.get("ASPIRE_REAL_MODELS_DIR", "/tmp/models")) / filename
    if staged.is_file():
        return str(staged)
    try:
        return resolve_alias(alias)
    except ModelNotFoundError as e:
        pytest.skip(f"{alias}: {e}")




@pytest.mark.parametrize("alias,filename,context", MODELS, ids=[m[0] for m in MODELS])
def test_deterministic_bf16_every_mode_is_ar_on_real_models(alias, filename, context):
    path = _model_path(alias, filename)
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    outputs, prompts = {}, None
    for mode in SPEC_MODES:
        with LLM(model=path, device="cuda", dtype="bfloat16", spec_mode=mode, deterministic=True,
                 max_num_seqs=64) as llm:  # fmt: skip
            if prompts is None:
                with scripts_imported("workloads") as (workloads,):
                    prompts = workloads.long_context_prompts(llm.tokenizer, 64, context)
            outputs[mode] = [o.token_ids for o in llm.generate(prompts, params)]
    for mode in SPEC_MODES[1:]:
        parted = sum(a != b for a, b in zip(outputs[mode], outputs["ar"], strict=True))
        assert parted == 0, f"{mode}: {parted} of 64 requests part from ar"
