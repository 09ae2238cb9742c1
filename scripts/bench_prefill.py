"""Prefill throughput: prompt chunks through the paged kernel against SDPA, side by side.

A prefill step is compute-bound: its floor is its FLOPs (2 x weights x tokens for the dense
layers, 4 x head_dim x q heads x the causal query-key pairs for attention, per layer) over the
bf16 matmul throughput measured in the same run (an 8192^3 GEMM). One engine, the same prompts
prefilled (``bench_decode.prefill_batch``: decoding paused) with the attention backend's
``prefill_sdpa`` switched between "off" (every row through the paged kernel) and "on" (rows of
``sdpa_min_queries`` queries or more through torch's SDPA, ``kernels/sdpa_rows.py``), in turns,
``--repeats`` times each; medians reported.

    python3 scripts/bench_prefill.py --model <qwen gguf> --context 16000 --batch 16 \\
        --out docs/bench_prefill_h200_qwen05b_16k.json
    python3 scripts/bench_prefill.py --dummy-shapes tiny-qwen3 --device cpu --dtype float32 \\
        --context 200 --batch 2 --max-batched-tokens 256     # the CPU smoke run of the tests
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from dataclasses import replace

import torch
from bench_decode import DUMMY_SHAPES, prefill_batch, random_prompts
from workloads import long_context_prompts

from aspire_ray import LLM, SamplingParams
from aspire_ray.model.arch import ModelArch
from aspire_ray.worker.model_loading import load_hf_config


def matmul_flops_per_s(device: torch.device, n: int = 8192, repeats: int = 10) -> float | None:
    """bf16 GEMM throughput (FLOP/s), best of ``repeats``; None off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * n**3 / best


def prefill_flops(arch: ModelArch, params: int, prompt_lens: list[int]) -> float:
    """FLOPs of prefilling these prompts: 2 per weight per token (params: the decoder's, the
    LM head left out: a prompt's logits are its last token's), attention 4 x head_dim x q heads
    per causal (query, key) pair and layer (chunks see their earlier chunks' keys: the pairs
    are the whole prompt's)."""
    pairs = sum(n * (n + 1) // 2 for n in prompt_lens)
    attention = 4 * arch.head_dim * arch.num_heads * pairs * arch.num_layers
    return 2 * params * sum(prompt_lens) + attention


def timed_prefill(llm: LLM, prompts: list[list[int]], tag: str) -> dict:
    """Prefill every prompt (decoding paused), then drop the requests -> seconds and steps."""
    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    steps = engine.step_count
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    ids, _ = prefill_batch(engine, prompts, params, tag)
    sync()
    seconds = time.perf_counter() - t0
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    return {"seconds": seconds, "steps": engine.step_count - steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dummy-shapes", choices=sorted(DUMMY_SHAPES), default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--context", type=int, default=16000)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=16384)
    p.add_argument("--sdpa-min-queries", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    kw = {"model": args.model}
    if args.dummy_shapes:
        pages = args.batch * (-(-(args.context + 64) // 16) + 1)
        kw = dict(model="dummy", load_format="dummy", hf_overrides=DUMMY_SHAPES[args.dummy_shapes],
                  num_pages=pages)  # fmt: skip
    llm = LLM(device=args.device, dtype=args.dtype, spec_mode="ar", attention_backend="triton",
              max_num_seqs=args.batch, max_num_batched_tokens=args.max_batched_tokens,
              calibrate="off", **kw)  # fmt: skip
    worker = llm.engine.executor.worker
    backend = worker.backend
    if args.dummy_shapes:
        prompts = random_prompts(args.batch, args.context, llm.engine.info.vocab_size)
    else:
        prompts = long_context_prompts(llm.tokenizer, args.batch, args.context)
    arch = ModelArch.from_hf_config(load_hf_config(llm.engine.cfg))
    elem = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    # weight_bytes leaves the embedding out: with tied embeddings that is the head too
    head = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    params = llm.engine.info.weight_bytes // elem - head
    flops = prefill_flops(arch, params, [len(x) for x in prompts])
    peak = matmul_flops_per_s(worker.device)
    base = backend.config
    settings = {"kernel": replace(base, prefill_sdpa="off"),
                "sdpa": replace(base, prefill_sdpa="on", sdpa_min_queries=args.sdpa_min_queries)}
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    timed_prefill(llm, prompts[:2], "warmup")  # compiles, captures
    for rep in range(args.repeats):
        for name, config in settings.items():
            backend.config = config
            timed_prefill(llm, prompts[:1], f"warm-{name}-{rep}")
            runs[name].append(timed_prefill(llm, prompts, f"{name}-{rep}"))
            r = runs[name][-1]
            print(f"[{name} rep {rep}] {r['seconds']:.3f} s, {r['steps']} steps", flush=True)
    backend.config = base
    tokens = sum(len(x) for x in prompts)
    result = {"command": shlex.join(["python3", *sys.argv]), "args": vars(args),
              "device": str(worker.device), "gpu": torch.cuda.get_device_name()
              if torch.cuda.is_available() else None,
              "prompt_tokens": tokens, "flops": flops, "matmul_flops_per_s": peak,
              "floor_s": flops / peak if peak else None, "results": {}}  # fmt: skip
    for name, rs in runs.items():
        seconds = statistics.median(r["seconds"] for r in rs)
        result["results"][name] = {
            "seconds_median": seconds, "seconds_all": [r["seconds"] for r in rs],
            "steps": rs[0]["steps"], "tokens_per_s": tokens / seconds,
            "ratio_to_floor": seconds / result["floor_s"] if peak else None}
    k, s = (result["results"][n]["seconds_median"] for n in ("kernel", "sdpa"))
    result["sdpa_speedup"] = k / s
    print(json.dumps({n: {key: v for key, v in r.items() if key != "seconds_all"}
                      for n, r in result["results"].items()}, indent=2))
    print(f"sdpa / kernel: {k / s:.2f}x faster")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    llm.shutdown()


if __name__ == "__main__":
    main()
