"""Tensor parallelism on two CUDA GPUs with the graphs captured on every shard (issue 17:
``tp_cuda_graphs``; skipped without two GPUs): in fp32 every mode's greedy output at TP=2
equals TP=1's, and both ranks replayed their decode steps as whole-step graphs, NCCL's
all-reduces inside. The CPU runs the same graph code at TP=2 over gloo (test_tp_graphs.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers import local_ray, random_prompts, run_staggered

from aspire_ray import SamplingParams
from aspire_ray.config import SPEC_MODES
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

ray = pytest.importorskip("ray")

# 12 q / 2 kv heads: TP=2 splits both (Qwen2.5-Coder-1.5B's heads, a smaller model)
SHAPES = dict(model_type="qwen2", hidden_size=768, intermediate_size=2048,
              num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=2,
              vocab_size=32000, max_position_embeddings=8192, rope_theta=1000000.0,
              tie_word_embeddings=True, rms_norm_eps=1e-6)


def _run(mode: str, tp: int) -> tuple[dict, list]:
    cfg = build_engine_config("dummy", load_format="dummy", hf_overrides=SHAPES, device="cuda",
                              dtype="float32", spec_mode=mode, tp_size=tp, num_pages=2048,
                              max_num_batched_tokens=2048, k_min=8, recent_pages=2,
                              calibrate="off", tp_cuda_graphs=True)  # fmt: skip
    engine = LLMEngine(cfg)
    try:
        # contexts up to 1200 tokens: sparse draft rows (k_min 8 pages) and split-KV rows
        prompts = random_prompts(6, [1, 300, 1200], vocab=32000, seed=5)
        params = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
                  for _ in prompts]  # fmt: skip
        out = run_staggered(engine, prompts, params, arrive_every=2)
        ex = engine.executor
        counts = ex.call_ranks("graph_counters") if tp > 1 else [ex.worker.graph_counters()]
        return out, counts
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def ray_local():
    with local_ray(num_cpus=8):
        yield


@pytest.mark.parametrize("mode", SPEC_MODES)
def test_tp2_graphs_fp32_equal_tp1(ray_local, mode):
    one, _ = _run(mode, 1)
    two, counts = _run(mode, 2)
    assert two == one
    assert len(counts) == 2 and counts[0] == counts[1], counts  # the same graphs on both ranks
    whole = sum(counts[0].get(f, 0) for f in ("step", "chain", "verify", "async"))
    assert whole > 20, counts  # the decode steps replayed whole-step graphs
