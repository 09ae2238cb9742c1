"""Where a deterministic run parts from its reference (issue 18): greedy token ids of several
engine configurations on the same prompts, each compared with the first configuration.

    python scripts/diag_det.py --dummy-shapes smollm2 --batch 64 --context 2000 \
        --max-tokens 128 --configs "ar/det;ar/det@max_num_batched_tokens=4096;magicdec/det"

A configuration is a bench_decode mode, then optional engine options after "@" (name=int,
comma-separated). For each: requests identical to the reference, and the first divergent
position of the others (min / median). Random weights give near-uniform logits, so any
difference in a row's bits soon flips a greedy token: a sensitive probe.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

from bench_decode import DUMMY_SHAPES, mode_environment, mode_options
from workloads import long_context_prompts

from aspire_ray import LLM, SamplingParams


def parse_config(text: str) -> tuple[str, dict]:
    mode, _, opts = text.partition("@")
    spec_mode, options = mode_options(mode)
    for item in filter(None, opts.split(",")):
        name, _, value = item.partition("=")
        options[name] = bool(int(value)) if name == "cuda_graphs" else int(value)
    return spec_mode, options


def first_divergence(a: list[int], b: list[int]) -> int | None:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model path (default: --dummy-shapes)")
    p.add_argument("--dummy-shapes", choices=sorted(DUMMY_SHAPES), default="smollm2")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--configs", required=True, help="';'-separated, the first is the reference")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    base = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.batch)
    if args.model:
        base["model"] = args.model
    else:
        pages = -(-(args.context + args.max_tokens + 64) // 16)
        base.update(model="dummy", load_format="dummy",
                    hf_overrides=DUMMY_SHAPES[args.dummy_shapes],
                    num_pages=(args.batch + 4) * pages, calibrate="off")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    reference, report = None, []
    for text in args.configs.split(";"):
        spec_mode, options = parse_config(text)
        with mode_environment(text.partition("@")[0]):  # its kernel switches ("ar/pdl")
            llm = LLM(spec_mode=spec_mode, **{**base, **options})
            if args.model:
                prompts = long_context_prompts(llm.tokenizer, args.batch, args.context)
            else:
                import random

                rng = random.Random(0)
                vocab = llm.engine.info.vocab_size
                prompts = [[rng.randrange(vocab) for _ in range(args.context)]
                           for _ in range(args.batch)]
            outs = [o.token_ids for o in llm.generate(prompts, params)]
            llm.shutdown()
            del llm
            gc.collect()
        if reference is None:
            reference = outs
        firsts = [first_divergence(a, b) for a, b in zip(outs, reference, strict=True)]
        parted = sorted(f for f in firsts if f is not None)
        row = dict(config=text, identical=len(firsts) - len(parted), requests=len(firsts),
                   first_min=parted[0] if parted else None,
                   first_median=statistics.median(parted) if parted else None)
        report.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": report}, f, indent=1)


if __name__ == "__main__":
    main()
