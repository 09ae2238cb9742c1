"""scripts/bench_prefill.py: its FLOP count by hand, and one CPU run (Triton's interpreter) of
both settings on a tiny random model (valid JSON, the same steps either way)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import one_thread_env, scripts_imported
from transformers import AutoConfig

from aspire_ray.model.arch import ModelArch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_prefill_flops_by_hand():
    cfg = AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, head_dim=16,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=256)  # fmt: skip
    arch = ModelArch.from_hf_config(cfg)
    with scripts_imported("bench_prefill") as (bp,):
        flops = bp.prefill_flops(arch, params=1000, prompt_lens=[3, 2])
    # dense: 2 x 1000 x 5 tokens; attention: 4 x 16 x 4 heads x (6 + 3) pairs x 4 layers
    assert flops == 2 * 1000 * 5 + 4 * 16 * 4 * 9 * 4


@pytest.mark.timeout(240)
def test_script_runs_on_cpu(tmp_path):
    out = tmp_path / "prefill.json"
    cmd = [sys.executable, str(SCRIPTS / "bench_prefill.py"), "--dummy-shapes", "tiny-qwen3",
           "--device", "cpu", "--dtype", "float32", "--context", "80", "--batch", "2",
           "--max-batched-tokens", "64", "--sdpa-min-queries", "16", "--repeats", "1",
           "--out", str(out)]  # fmt: skip
    env = dict(one_thread_env(), TRITON_INTERPRET="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=230, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    kernel, sdpa = data["results"]["kernel"], data["results"]["sdpa"]
    assert data["prompt_tokens"] == 160 and data["floor_s"] is None  # no GEMM timed on a CPU
    assert kernel["steps"] == sdpa["steps"] >= 3  # 64-token chunks: earlier chunks' keys seen
    assert data["sdpa_speedup"] == pytest.approx(kernel["seconds_median"] / sdpa["seconds_median"])
