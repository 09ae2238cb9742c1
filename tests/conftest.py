"""Shared fixtures: tiny random HF models (Llama, Qwen2, Qwen3) saved as HF directories."""

from __future__ import annotations

import os

# One OpenBLAS thread too (numpy's, which torch imports next: the variable is read when it
# loads). Triton's interpreter runs every tl.dot as a numpy matmul, and a second BLAS thread
# spins at each while another process holds the other core: tests/kernels/
# test_paged_attention.py took 49 s beside one busy process, 43 s with one thread (44 s and
# 43 s alone).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread: the tiny models' ops are too small to gain from a second one, and a
# second OpenMP thread waits at every op's barrier while another process (a Ray actor, a
# server subprocess, another job on a shared runner) holds the other core. Beside one busy
# core, test_draft_chains.py and test_spec_exact.py took 3.4x as long on 2 threads, 1.2x on 1.
torch.set_num_threads(1)

# Without a GPU the Triton kernels run in Triton's interpreter. The variable must be set before
# any kernel module is imported (``triton.jit`` reads it when it decorates a function): this
# conftest is imported before pytest collects any test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=256, max_position_embeddings=2048, rope_theta=10000.0,
                  tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=256, max_position_embeddings=2048, rope_theta=10000.0,
                  tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, head_dim=32,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
                  vocab_size=256, max_position_embeddings=2048, rope_theta=10000.0,
                  tie_word_embeddings=False),
    "llama3_scaled": dict(model_type="llama", hidden_size=64, intermediate_size=128,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                          vocab_size=256, max_position_embeddings=2048, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 256},
                          tie_word_embeddings=True),
}
# Smaller models for the tests that run the engine under Triton's interpreter (emulated
# graphs), where each layer's kernels are interpreted program by program. 3 layers still put
# layers before, at and after the refresh layer (num_layers - 2) of the page-scoring modes; 2
# serve the modes that score no pages (ar, magicdec). One kv head (GQA group 4, as qwen3): the
# attention, page-score and KV-store grids run a program per kv head, so a third off these
# tests; grids over several kv heads are tested in tests/kernels.
TINY_CONFIGS["llama_3l"] = dict(TINY_CONFIGS["llama"], num_hidden_layers=3, num_key_value_heads=1)
TINY_CONFIGS["llama_2l"] = dict(TINY_CONFIGS["llama_3l"], num_hidden_layers=2)


def make_tiny_model(path, family: str, seed: int = 0):
    """Save a random-weight HF model; weights are scaled up so that logits are peaked
    (random init at std 0.02 gives near-uniform logits, where fp32 ties decide greedy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_CONFIGS[family])
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, eos_token_id=None, bos_token_id=None, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
    model.save_pretrained(str(path))
    return model


def pytest_collection_modifyitems(config, items):
    """The files that hold slow tests first, each file's tests together and in their order:
    the README runs the suite on two workers (pytest-xdist, a file to a worker), and a long
    file handed out last would leave one worker idle while the other ends it (longest first)."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: files stay contiguous


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """family -> path of a saved tiny random HF model."""
    cache: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            make_tiny_model(path, family)
            cache[family] = str(path)
        return cache[family]

    return get
