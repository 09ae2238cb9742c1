"""Profile decode steps of the engine on a GPU: where does a step's wall time go?

Per (mode, batch, graphs on/off): wall ms per decode step, GPU kernel time per step, kernel
and graph launches per step (torch.profiler), and the worker's prepare / forward / sample split.
A step is CPU-bound when its wall time is well above its GPU time.

    python scripts/profile_step.py --modes ar,aspire_fixed --batches 16,64 --context 2048 \
        --graphs both --out profile.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config

SMOLLM2_SHAPES = dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def _engine(mode: str, args, graphs: bool) -> LLMEngine:
    cfg = build_engine_config("dummy", load_format="dummy", hf_overrides=SMOLLM2_SHAPES,
                              device="cuda", dtype=args.dtype, spec_mode=mode,
                              attention_backend=args.backend, num_pages=args.num_pages,
                              max_num_batched_tokens=16384, max_num_seqs=256,
                              calibrate="off", cuda_graphs=graphs)  # fmt: skip
    engine = LLMEngine(cfg)
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        ids = torch.randint(0, 49152, (args.context,), generator=g).tolist()
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=8192 - args.context - 64,
                                                        temperature=0, ignore_eos=True))
    while any(r.in_prefill or r.num_computed == 0 for r in engine.requests.values()):
        engine.step()
    for _ in range(6):
        engine.step()
    return engine


def _profile(engine: LLMEngine, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
                 for e in events if str(e.device_type).endswith("CUDA"))  # kernels, copies
    launches = sum(e.count for e in events if e.key in LAUNCHES)
    graph_launches = sum(e.count for e in events if e.key == "cudaGraphLaunch")
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:8]
    return {"gpu_ms_per_step": gpu_us / 1e3 / steps, "kernel_launches_per_step": launches / steps,
            "graph_launches_per_step": graph_launches / steps,
            "top_cpu_ops": [(e.key, e.count // steps, round(e.self_cpu_time_total / steps))
                            for e in top]}  # fmt: skip


def _host_profile(engine: LLMEngine, steps: int, top: int) -> list[tuple[str, int, float, float]]:
    """cProfile of ``steps`` engine steps: the host functions with the most own time
    (name, calls per step, own us per step, cumulative us per step)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof).stats  # (file, line, func) -> (cc, nc, tottime, cumtime, callers)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [(f"{f.rsplit('/', 2)[-1]}:{line}({fn})", nc // steps, round(tt / steps * 1e6),
             round(ct / steps * 1e6)) for (f, line, fn), (_, nc, tt, ct, _) in rows]


def run(mode: str, args, graphs: bool) -> dict:
    engine = _engine(mode, args, graphs)
    before = dict(engine.stats()["timings"])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / args.steps
    after = engine.stats()["timings"]
    split = {k: round((after[k] - before.get(k, 0.0)) / args.steps * 1e3, 3)
             for k in ("prepare", "forward", "sample", "refresh", "schedule", "commit")
             if k in after}  # fmt: skip
    result = {"mode": mode, "batch": args.batch, "context": args.context, "graphs": graphs,
              "wall_ms_per_step": wall * 1e3, "worker_ms_per_step": split}
    result.update(_profile(engine, args.profile_steps))
    print(f"{mode:>13} batch={args.batch:<3} ctx={args.context} graphs={str(graphs):<5}: "
          f"{result['wall_ms_per_step']:7.2f} ms/step wall, {result['gpu_ms_per_step']:6.2f} ms "
          f"GPU, {result['kernel_launches_per_step']:6.0f} kernel + "
          f"{result['graph_launches_per_step']:3.0f} graph launches/step; {split}", flush=True)
    print("    top CPU ops (name, calls/step, us/step):", result["top_cpu_ops"], flush=True)
    if args.cprofile:
        result["host_profile"] = _host_profile(engine, args.cprofile, 30)
        print("    host functions (name, calls/step, own us/step, cumulative us/step):")
        for row in result["host_profile"]:
            print("     ", *row, flush=True)
    del engine
    torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="16")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--modes", default="ar")
    p.add_argument("--graphs", choices=("on", "off", "both"), default="both")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--profile-steps", type=int, default=6)
    p.add_argument("--num-pages", type=int, default=20000)
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cprofile", type=int, default=0,
                   help="also cProfile this many steps and print the hottest host functions")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    graph_opts = {"on": [True], "off": [False], "both": [False, True]}[args.graphs]
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        args.batch = batch
        for mode in args.modes.split(","):
            for graphs in graph_opts:
                results.append(run(mode, args, graphs))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
