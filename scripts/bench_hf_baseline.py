"""Peer baseline: Hugging Face transformers `generate` (static cache) vs our `ar`, same GPU,
model shape, batch and context, side by side in one process. Decode tokens/s only: the
transformers time of a 1-token generate (prefill) is subtracted from a N-token generate.

    python scripts/bench_hf_baseline.py --shape smollm2 --batch 64 --context 2048 --new 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_decode import DUMMY_SHAPES, decode_run, random_prompts

from aspire_ray import LLM, SamplingParams


def hf_decode_tps(shape: dict, prompts: list[list[int]], new: int) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(shape)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts, device="cuda")

    def timed(n: int) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, do_sample=False, cache_implementation="static")
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    timed(2)  # warm-up (allocations, kernels)
    prefill = min(timed(1) for _ in range(2))
    total = min(timed(new) for _ in range(2))
    decode = total - prefill
    return {"tokens_per_s": len(prompts) * (new - 1) / decode, "decode_s": decode,
            "prefill_s": prefill}


def ours_decode_tps(shape: dict, prompts: list[list[int]], new: int) -> dict:
    pages = len(prompts) * (-(-(len(prompts[0]) + new + 64) // 16)) + 64
    llm = LLM("dummy", load_format="dummy", hf_overrides=shape, device="cuda", dtype="bfloat16",
              spec_mode="ar", calibrate="off", num_pages=pages, max_num_seqs=len(prompts),
              max_num_batched_tokens=16384)
    decode_run(llm, prompts[:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
               "warmup")
    run = decode_run(llm, prompts, SamplingParams(max_tokens=new, temperature=0,
                                                  ignore_eos=True), "ours")
    llm.shutdown()
    return {"tokens_per_s": run["tokens"] / run["seconds"], "decode_s": run["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="smollm2", choices=sorted(DUMMY_SHAPES))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shape = DUMMY_SHAPES[args.shape]
    prompts = random_prompts(args.batch, args.context, shape["vocab_size"])
    ours = ours_decode_tps(shape, prompts, args.new)
    hf = hf_decode_tps(shape, prompts, args.new)
    ratio = ours["tokens_per_s"] / hf["tokens_per_s"]
    print(f"batch {args.batch} ctx {args.context}: ours ar {ours['tokens_per_s']:.0f} tok/s, "
          f"transformers generate (static cache) {hf['tokens_per_s']:.0f} tok/s -> {ratio:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "ours": ours, "transformers": hf, "ratio": ratio}, f,
                      indent=1)


if __name__ == "__main__":
    main()
