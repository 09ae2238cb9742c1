"""Profile decode steps of the engine on a GPU: where does a step's wall time go?

    python scripts/profile_step.py --batch 16 --context 2048 --mode ar --steps 10
"""

from __future__ import annotations

import argparse
import time

import torch

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config

SMOLLM2_SHAPES = dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--mode", default="ar")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--trace", default=None)
    args = p.parse_args()
    cfg = build_engine_config("dummy", load_format="dummy", hf_overrides=SMOLLM2_SHAPES,
                              device="cuda", dtype=args.dtype, spec_mode=args.mode,
                              attention_backend=args.backend, num_pages=20000,
                              max_num_batched_tokens=16384, max_num_seqs=256,
                              calibrate="off")
    engine = LLMEngine(cfg)
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        ids = torch.randint(0, 49152, (args.context,), generator=g).tolist()
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=10_000 // 8, temperature=0,
                                                        ignore_eos=True))
    while any(r.in_prefill or r.num_computed == 0 for r in engine.requests.values()):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t0) / args.steps
    print(f"{args.mode} backend={engine.executor.worker.backend.name} batch={args.batch} "
          f"ctx={args.context}: {per_step * 1e3:.2f} ms/step wall")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
