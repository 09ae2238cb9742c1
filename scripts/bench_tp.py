"""Tensor parallelism on GPUs: TP=1 vs TP=N side by side on a random-weight model at a real
shape: greedy token match rate, decode tokens/s, per-step orchestration overhead (driver-side
step time minus the shard's own time) at several batch sizes, and the calibrated cost-model
coefficients with r^2 for each TP degree.

    python scripts/bench_tp.py --shape qwen3-8b --tp 1 2 --context 4096 --batches 1 16 64 \
        --out docs/bench_tp_h200x2.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch

from aspire_ray import LLM, SamplingParams

SHAPES = {
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    # CPU smoke runs only (--device cpu --dtype float32)
    "tiny-qwen3": dict(model_type="qwen3", hidden_size=128, intermediate_size=256,
                       num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, vocab_size=512, max_position_embeddings=4096),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "llama-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                     vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
                     rms_norm_eps=1e-5, tie_word_embeddings=False,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}),
}


def run(args, tp: int, mode: str) -> dict:
    llm = LLM("dummy", load_format="dummy", hf_overrides=SHAPES[args.shape], device=args.device,
              dtype=args.dtype, spec_mode=mode, tp_size=tp,
              calibrate=args.calibrate if mode == "aspire" else "off",
              max_num_seqs=max(args.batches), max_num_batched_tokens=16384)
    rng = random.Random(0)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(args.context)]
               for _ in range(max(args.batches))]
    result = {"tp": tp, "mode": mode, "batches": {}}
    tokens = None
    for b in args.batches:
        engine = llm.engine
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        for i in range(b):
            engine.add_request(f"b{b}-{i}", prompts[i], params)
        done = {}
        engine.scheduler.pause_decoding = True  # all rows start decoding in the same step
        while any(r.in_prefill or r.num_computed == 0 for r in engine.requests.values()):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        engine.scheduler.pause_decoding = False
        s0 = dict(engine.stats()["timings"])
        steps0 = engine.step_count
        t0 = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
        wall = time.perf_counter() - t0
        if not engine.healthy or steps0 == engine.step_count:
            raise RuntimeError(f"tp={tp} {mode} batch {b}: no decode step ran "
                               f"(engine healthy={engine.healthy}, error={engine.error})")
        s1 = engine.stats()["timings"]
        steps = engine.step_count - steps0
        execute = s1["execute"] - s0.get("execute", 0)
        worker = s1["total"] - s0.get("total", 0)
        result["batches"][b] = {
            "tokens_per_s": b * args.max_tokens / wall,
            "step_ms": 1e3 * execute / steps,
            "worker_ms": 1e3 * worker / steps,
            "overhead_ms": 1e3 * (execute - worker) / steps,
            "overhead_fraction": (execute - worker) / execute,
        }
        if b == max(args.batches):
            tokens = [done[f"b{b}-{i}"] for i in range(b)]
    result["cost_model"] = llm.engine.stats()["cost_model"]
    result["tokens"] = tokens
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():  # tp=1 runs in this process: free GPU 0 for the next run
        torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    p.add_argument("--modes", nargs="+", default=["ar", "aspire"])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--calibrate", default="force")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    results = []
    for mode in args.modes:
        for tp in args.tp:
            r = run(args, tp, mode)
            results.append(r)
            ref = next(x for x in results if x["mode"] == mode and x["tp"] == args.tp[0])
            same = sum(a == b for a, b in zip(r["tokens"], ref["tokens"], strict=True))
            r["identical_requests_vs_tp1"] = same / len(r["tokens"])
            agree = sum(sum(x == y for x, y in zip(a, b, strict=True))
                        for a, b in zip(r["tokens"], ref["tokens"], strict=True))
            r["token_agreement"] = agree / sum(len(a) for a in r["tokens"])
            c = r["cost_model"]
            print(f"{mode:7s} tp={tp}: " + "  ".join(
                f"B={b}: {v['tokens_per_s']:.0f} tok/s step {v['step_ms']:.2f} ms overhead "
                f"{100 * v['overhead_fraction']:.1f}%" for b, v in r["batches"].items())
                + f"  identical={r['identical_requests_vs_tp1']:.2f}"
                f"  cost b=({c['b_model']:.3g}, {c['b_tok']:.3g}, {c['b_kv']:.3g}) r2={c['r2']}",
                flush=True)
    if args.out:
        for r in results:
            r.pop("tokens")
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
