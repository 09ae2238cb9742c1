"""Acceptance by draft position and mean accepted length per draft policy (CPU or GPU).

Measures, on real long text, how well each sparse draft agrees with the target:
`magicdec` (StreamingLLM window), `specattn` (top-k at verification only = no refresh) and
`aspire_fixed` (refresh-layer top-k) at a fixed draft length, plus a refresh-layer sweep.

    python scripts/bench_acceptance.py --context 4096 --requests 4 --max-tokens 96 \
        --gamma 10 --out docs/acceptance_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

from workloads import long_context_prompts

from aspire_ray import LLM, SamplingParams
from aspire_ray.config import SPEC_MODES


def run(mode: str, prompts, args, **overrides) -> dict:
    llm = LLM(model=args.model, spec_mode=mode, dtype=args.dtype, device=args.device,
              gamma=args.gamma, d_max=max(args.gamma, 16), num_pages=args.num_pages,
              max_num_batched_tokens=args.batch_tokens, calibrate="off", **overrides)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=0, ignore_eos=True)
    t0 = time.time()
    outs = llm.generate(prompts, params)
    elapsed = time.time() - t0
    drafted = [0] * args.gamma
    accepted = [0] * args.gamma
    verifications = acc_total = 0
    for o in outs:
        m = o.metrics
        verifications += m.verifications
        acc_total += m.accepted
        for j, (d, a) in enumerate(zip(m.drafted_by_position, m.accepted_by_position,
                                       strict=True)):
            if j < args.gamma:
                drafted[j] += d
                accepted[j] += a
    llm.shutdown()
    by_pos = [a / d if d else None for a, d in zip(accepted, drafted, strict=True)]
    return {
        "mode": mode,
        **overrides,
        "acceptance_rate": sum(accepted) / max(sum(drafted), 1),
        "acceptance_by_position": by_pos,
        "mean_accepted_length": (acc_total + verifications) / max(verifications, 1),
        "verifications": verifications,
        "seconds": elapsed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--gamma", type=int, default=10)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-pages", type=int, default=2048)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--modes", default="magicdec,specattn,aspire_fixed",
                   help="comma list of the speculative modes to measure, in this order")
    p.add_argument("--refresh-layers", default="29,26,22,15,8",
                   help="refresh layers for the sweep besides the default N-2 ('' to skip)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    speculative = [m for m in SPEC_MODES if m != "ar"]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in speculative]
    if unknown or not modes:
        p.error(f"--modes: {unknown or 'none'} not among {speculative}")

    llm = LLM(model=args.model, spec_mode="ar", num_pages=8)
    prompts = long_context_prompts(llm.tokenizer, args.requests, args.context)
    n_layers = llm.engine.info.num_layers
    llm.shutdown()

    report = {
        "command": "python scripts/bench_acceptance.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "model": args.model, "num_layers": n_layers, "context": args.context,
        "requests": args.requests, "max_tokens": args.max_tokens, "gamma": args.gamma,
        "machine": platform.processor() or platform.machine(),
        "modes": [], "refresh_layer_sweep": [],
    }
    runs = [(mode, "modes", {}) for mode in modes]
    runs += [("aspire_fixed", "refresh_layer_sweep", {"refresh_layer": int(layer)})
             for layer in filter(None, args.refresh_layers.split(","))]
    for mode, part, overrides in runs:
        r = run(mode, prompts, args, **overrides)
        report[part].append(r)
        print(json.dumps(r), flush=True)
        if args.out:  # after every policy: a CPU run at 16k takes ~40 minutes a policy
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
