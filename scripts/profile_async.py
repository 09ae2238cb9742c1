"""Where an asynchronous run's GPU time goes (``aspire``): kernel time by kernel name over a
few profiled runs, at a dummy model's real shape (random weights, no download).

    python scripts/profile_async.py --shapes qwen2.5-coder-0.5b --context 32000 --batch 64
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict

import torch
from bench_decode import DUMMY_SHAPES, prefill_batch
from workloads import long_context_prompts

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", choices=sorted(DUMMY_SHAPES), default="qwen2.5-coder-0.5b")
    p.add_argument("--model", default=None, help="a real model (alias, GGUF, HF dir; prompts "
                   "of real code then) instead of the dummy shapes")
    p.add_argument("--mode", default="aspire")
    p.add_argument("--context", type=int, default=32000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--runs", type=int, default=2, help="plans profiled (after two warm ones)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--timeline", type=int, default=0,
                   help="also list the first N kernels in order (start, name, us)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    model = dict(model=args.model) if args.model else \
        dict(model="dummy", load_format="dummy", hf_overrides=DUMMY_SHAPES[args.shapes])
    cfg = build_engine_config(**model, device="cuda", dtype="bfloat16", spec_mode=args.mode,
                              max_num_seqs=args.batch, max_model_len=args.context + 1024,
                              calibrate="auto")  # fmt: skip
    engine = LLMEngine(cfg)
    if args.model:  # windows of real text, as bench_decode's
        prompts = long_context_prompts(engine.tokenizer, args.batch, args.context)
    else:
        rng = random.Random(0)
        vocab = engine.info.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(args.context)]
                   for _ in range(args.batch)]  # fmt: skip
    params = SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True)
    if args.model:  # the cost model's draft lengths follow the text's acceptance
        for _ in range(6):
            engine.step()
    prefill_batch(engine, prompts, params, "p")
    for _ in range(2):
        engine.step()
    torch.cuda.synchronize()
    steps_before = dict(engine.step_kinds)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.runs):
            engine.step()
        torch.cuda.synchronize()
    steps = {k: v - steps_before.get(k, 0) for k, v in engine.step_kinds.items()}
    n_steps = sum(steps.values())
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    kernels_in_order = []  # (start us, name, us): where one step's time goes, kernel by kernel
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += e.device_time_total / 1e3
            by_name[e.name][1] += 1
            kernels_in_order.append((e.time_range.start, e.name[:48], e.device_time_total))
    kernels_in_order.sort()
    total = sum(v[0] for v in by_name.values())
    kernels = sum(v[1] for v in by_name.values())
    report = {"mode": args.mode, "shapes": args.shapes, "context": args.context,
              "batch": args.batch, "steps": steps, "gpu_ms_per_step": total / n_steps,
              "kernels_per_step": kernels / n_steps,
              "top": [(name[:90], round(ms / n_steps, 4), cnt // n_steps)
                      for name, (ms, cnt) in sorted(by_name.items(), key=lambda kv: -kv[1][0])
                      [: args.top]],
              # GPU time between the first and the last kernel, over the kernels' own time:
              # the gaps are launches, drains and host waits
              "span_ms_per_step": (kernels_in_order[-1][0] - kernels_in_order[0][0]) / 1e3
              / n_steps if kernels_in_order else 0.0,
              "timeline": _timeline(kernels_in_order, args.timeline),
              "cost_model": engine.cost_model.summary(),
              "calibration_samples": engine.calibration and engine.calibration.samples}  # fmt: skip
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


def _timeline(kernels: list[tuple[float, str, float]], n: int) -> list[tuple[float, str, float]]:
    """The first n kernels as (start us from the first, name, us)."""
    if not kernels or n <= 0:
        return []
    t0 = kernels[0][0]
    return [(round(t - t0, 1), name, round(us, 1)) for t, name, us in kernels[:n]]


if __name__ == "__main__":
    main()
