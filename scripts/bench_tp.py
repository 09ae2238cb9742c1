"""Tensor parallelism: TP=1 against TP=N, mode by mode, on random weights at a real shape and
on real models (issue 17, item 4).

For every (model, spec mode, TP degree) one engine decodes each batch of ``--context``-token
prompts, greedy, all rows starting in the same step (bench_decode's ``decode_run``, steady
window). Per batch: decode tokens/s, worker step time by step kind, the orchestration share of
the driver's step (driver-side ``execute`` minus rank 0's own step time), the cost model. Against
the TP=1 run of the same model, mode and batch: speedup, scaling efficiency
(TP=1 time / (N x TP=N time)), TP=N step / TP=1 step by kind (issue 17's target: <= 0.6 for
``verify``, ar's step, and ``draft`` at TP=2; a mode's drafts run as a step of their own only
in a ``/noround`` variant, e.g. ``magicdec/noround``), and the greedy token match rate
(positions up to each request's first divergence, bench_decode's ``_match_rate``) and
identical requests.

    python scripts/bench_tp.py --dummy-shapes qwen3-8b --tp 1,2 --context 32000 \
        --batches 16,64 --isolate --out docs/bench_tp_h200x2_32k.json
    python scripts/bench_tp.py --models qwen2.5-coder-1.5b-instruct --tp 1,2 --context 32000 \
        --batches 16,64 --isolate --out docs/bench_tp_h200x2_qwen15b.json
    python scripts/bench_tp.py --device cpu --dtype float32 --dummy-shapes tiny-qwen3 --tp 1,2 \
        --context 200 --batches 2 --max-tokens 8 --calibrate off   # CPU, gloo

``--dummy-shapes`` (random weights, random-token prompts) and ``--models`` (a .gguf path, a HF
directory or an alias; prompts from workloads.long_context_prompts) are comma lists; with
neither, both defaults run. A batch the KV pool cannot hold is reported as skipped with the
batch that fits (the Qwen3-8B shape at 32k x 64 needs ~300 GB of KV). ``--isolate`` runs each
(model, mode, TP) in a process of its own, so one failure (or a leaked allocation) does not
end the sweep; the JSON is rewritten after every one, so a run cut short keeps what it did.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from workloads import long_context_prompts

from aspire_ray import LLM, SamplingParams
from aspire_ray.config import SPEC_MODES

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
DEFAULT_SHAPES = ["qwen3-8b"]
DEFAULT_MODELS = ["qwen2.5-coder-1.5b-instruct"]
TARGET_STEP_RATIO = 0.6  # issue 17: TP=2 step <= 0.6 x TP=1 step (ar's verify, draft)


def run_config(args, target: dict, tp: int, mode: str) -> list[dict]:
    """One engine for (target, tp, mode): a record per batch, token ids included."""
    import bench_decode  # here, not at the top: bench_decode imports SHAPES from this file
    dummy = target["shape"] is not None
    kw = dict(model="dummy", load_format="dummy", hf_overrides=SHAPES[target["shape"]]) \
        if dummy else dict(model=target["model"])  # fmt: skip
    if args.device == "cpu":  # no memory-based sizing on the CPU: a pool for the largest batch
        kw["num_pages"] = (max(args.batches) + args.warmup + 2) * _pages_per_request(args, 16, 64)
    spec_mode, options = bench_decode.mode_options(mode)
    llm = LLM(device=args.device, dtype=args.dtype, spec_mode=spec_mode, tp_size=tp,
              calibrate=args.calibrate if spec_mode == "aspire" else "off",
              max_num_seqs=max(args.batches), max_num_batched_tokens=args.max_batched_tokens,
              **options, **kw)
    engine = llm.engine
    n = max(args.batches)
    if dummy:
        vocab = SHAPES[target["shape"]]["vocab_size"]
        prompts = bench_decode.random_prompts(n, args.context, vocab)
    else:
        prompts = long_context_prompts(llm.tokenizer, n, args.context)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    if args.warmup:
        warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        bench_decode.decode_run(llm, prompts[: args.warmup], warm, f"warmup-{mode}")
    records = []
    for b in args.batches:
        base = dict(target=target["label"], tp=tp, mode=mode, batch=b, context=args.context)
        fits = engine.blocks.num_free // _pages_per_request(args, engine.cfg.cache.page_size,
                                                            engine.cfg.spec.d_max)
        if fits < b:
            records.append(dict(base, skipped=f"the KV pool holds {fits} requests of "
                                              f"{args.context} tokens, not {b}"))
        else:
            run = bench_decode.decode_run(llm, prompts[:b], params, f"tp{tp}-{mode}-{b}")
            records.append(dict(base, **_measure(run, mode)))
        _progress(records[-1])
    llm.shutdown()
    del llm, engine
    gc.collect()
    if torch.cuda.is_available():  # tp=1 runs in this process: free GPU 0 for the next run
        torch.cuda.empty_cache()
    return records


def _pages_per_request(args, page_size: int, d_max: int) -> int:
    """Pages a request holds at its longest: prompt, new tokens, drafts (bench_decode's bound)."""
    return -(-(args.context + args.max_tokens + d_max + 2) // page_size)


def _measure(run: dict, mode: str) -> dict:
    import bench_decode
    s = bench_decode.summarize(mode, run, None)
    bd = s["breakdown"]
    t = bd["timings"]
    execute, worker = t.get("execute", 0.0), t.get("total", 0.0)
    kinds = {k: n for k, n in bd["step_kinds"].items() if n}
    return {
        "tokens_per_s": s["tokens_per_s"], "decode_seconds": s["decode_seconds"],
        "tokens": s["tokens"], "mean_accepted_length": s["mean_accepted_length"],
        "plans": bd["steps"], "steps_by_kind": kinds,
        # rank 0's seconds per step of each kind (a draft chain: per draft step)
        "step_ms_by_kind": {k: 1e3 * bd["step_seconds"][k] / n for k, n in kinds.items()},
        # the driver's ``execute`` per plan (a chain of steps is one plan)
        "driver_ms_per_plan": 1e3 * execute / max(bd["steps"], 1),
        "orchestration_fraction": (execute - worker) / execute if execute else None,
        "cost_model": bd["cost_model"],
        "token_ids": s["token_ids"],
    }


def _progress(r: dict) -> None:
    head = f"[{r['target']} {r['mode']} tp={r['tp']} batch {r['batch']}]"
    if "skipped" in r:
        print(f"{head} skipped: {r['skipped']}", flush=True)
        return
    kinds = ", ".join(f"{k} {v:.2f} ms" for k, v in r["step_ms_by_kind"].items())
    orch = r["orchestration_fraction"]
    orch = "-" if orch is None else f"{100 * orch:.1f}%"
    print(f"{head} {r['tokens_per_s']:.1f} tok/s; steps: {kinds}; orchestration {orch}",
          flush=True)


def compare(records: list[dict], ref_tp: int) -> list[dict]:
    """TP=N against the ref_tp run of the same target, mode and batch (both measured)."""
    from bench_decode import _match_rate
    ref = {(r["target"], r["mode"], r["batch"]): r for r in records
           if r["tp"] == ref_tp and "skipped" not in r and "error" not in r}
    out = []
    for r in records:
        one = ref.get((r["target"], r["mode"], r["batch"]))
        if r["tp"] == ref_tp or one is None or "skipped" in r or "error" in r:
            continue
        n = r["tp"] / ref_tp
        steps = {k: r["step_ms_by_kind"][k] / one["step_ms_by_kind"][k]
                 for k in r["step_ms_by_kind"] if one["step_ms_by_kind"].get(k)}
        same = sum(a == b for a, b in zip(r["token_ids"], one["token_ids"], strict=True))
        out.append({
            "target": r["target"], "mode": r["mode"], "batch": r["batch"], "tp": r["tp"],
            "ref_tp": ref_tp,
            "speedup": r["tokens_per_s"] / one["tokens_per_s"],
            # TP=1 time / (N x TP=N time): 1.0 is perfect scaling
            "scaling_efficiency": r["tokens_per_s"] / (n * one["tokens_per_s"]),
            "step_ratio_by_kind": steps,
            "meets_step_target": _meets(steps),
            "greedy_match_rate": _match_rate(r["token_ids"], one["token_ids"]),
            "identical_requests": same / len(r["token_ids"]),
        })
    return out


def _meets(ratios: dict[str, float]) -> bool | None:
    """Issue 17's target on ar's (verify) and draft steps; None where neither ran."""
    judged = [v for k, v in ratios.items() if k in ("verify", "draft")]
    return all(v <= TARGET_STEP_RATIO for v in judged) if judged else None


def table(records: list[dict], comparisons: list[dict]) -> str:
    """One row per run; a TP=N row also holds its comparison with TP=1."""
    cmp = {(c["target"], c["mode"], c["batch"], c["tp"]): c for c in comparisons}
    lines = ["| model | mode | batch | TP | tok/s | vs TP=1 | scaling eff. | step ms by kind "
             "(x TP=1's) | orchestration | greedy match | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        head = f"| {r['target']} | {r['mode']} | {r['batch']} | {r['tp']} |"
        if "skipped" in r or "error" in r:
            lines.append(f"{head} {r.get('skipped') or 'error: ' + r['error']} |||||||")
            continue
        c = cmp.get((r["target"], r["mode"], r["batch"], r["tp"]))
        ratios = c["step_ratio_by_kind"] if c else {}
        kinds = "; ".join(f"{k} {v:.2f}" + (f" ({ratios[k]:.2f}x)" if k in ratios else "")
                          for k, v in r["step_ms_by_kind"].items())
        orch = r["orchestration_fraction"]
        versus = f"x{c['speedup']:.2f} | {c['scaling_efficiency']:.2f}" if c else "- | -"
        match = f"{c['greedy_match_rate']:.3f} | {c['identical_requests']:.2f}" if c else "- | -"
        lines.append(f"{head} {r['tokens_per_s']:.0f} | {versus} | {kinds} | "
                     f"{'-' if orch is None else f'{100 * orch:.1f}%'} | {match} |")
    return "\n".join(lines)


def _targets(args) -> list[dict]:
    shapes, models = args.dummy_shapes, args.models
    if shapes is None and models is None:
        shapes, models = DEFAULT_SHAPES, DEFAULT_MODELS
    targets = [{"label": s, "shape": s, "model": None} for s in shapes or []]
    return targets + [{"label": Path(m).name, "shape": None, "model": m} for m in models or []]


def _in_child(args, target: dict, tp: int, mode: str) -> list[dict]:
    """run_config in a process of its own; a failure becomes one record with its error."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.json"
        job = json.dumps({"args": vars(args), "target": target, "tp": tp, "mode": mode,
                          "out": str(out)})
        proc = subprocess.run([sys.executable, __file__, "--child", job], check=False)
        if proc.returncode == 0 and out.is_file():
            return json.loads(out.read_text())
    error = f"exit status {proc.returncode}"
    print(f"[{target['label']} {mode} tp={tp}] failed: {error}", flush=True)
    return [dict(target=target["label"], tp=tp, mode=mode, batch=b, context=args.context,
                 error=error) for b in args.batches]


def _write(path: str | None, args, records: list[dict], comparisons: list[dict]) -> None:
    if path:
        kept = [{k: v for k, v in r.items() if k != "token_ids"} for r in records]
        with open(path, "w") as f:
            json.dump({"command": " ".join(sys.argv), "args": vars(args), "results": kept,
                       "comparisons": comparisons}, f, indent=1)


def _list(cast):
    """argparse type of a comma list; with nargs="+" both "1,2" and "1 2" work."""
    return lambda s: [cast(x) for x in s.split(",") if x]


def _flat(values):
    return None if values is None else [x for v in values for x in v]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dummy-shapes", "--shape", nargs="+", type=_list(str), default=None,
                   help=f"random-weight shapes, of {sorted(SHAPES)}")
    p.add_argument("--models", nargs="+", type=_list(str), default=None,
                   help="real models: .gguf paths, HF directories or aliases")
    p.add_argument("--tp", nargs="+", type=_list(int), default=[[1, 2]],
                   help="TP degrees; the first is the reference")
    p.add_argument("--modes", nargs="+", type=_list(str), default=[list(SPEC_MODES)],
                   help="spec modes, or bench_decode's MODE/VARIANT (e.g. magicdec/noround: "
                        "draft steps timed apart from verification)")
    p.add_argument("--context", type=int, default=32000)
    p.add_argument("--batches", nargs="+", type=_list(int), default=[[16, 64]])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2, help="requests of a warm-up batch")
    p.add_argument("--max-batched-tokens", type=int, default=16384)
    p.add_argument("--calibrate", default="force", help="aspire's cost-model calibration")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--isolate", action="store_true", help="one process per (model, mode, TP)")
    p.add_argument("--out", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        job = json.loads(args.child)
        records = run_config(argparse.Namespace(**job["args"]), job["target"], job["tp"],
                             job["mode"])
        Path(job["out"]).write_text(json.dumps(records))
        return
    for name in ("dummy_shapes", "models", "tp", "modes", "batches"):
        setattr(args, name, _flat(getattr(args, name)))
    unknown = [s for s in args.dummy_shapes or [] if s not in SHAPES]
    from bench_decode import mode_environment, mode_options  # exits on an unknown variant

    bad_modes = [m for m in args.modes if mode_options(m)[0] not in SPEC_MODES]
    if unknown:
        p.error(f"unknown shapes {unknown} (known: {sorted(SHAPES)})")
    if bad_modes:
        p.error(f"unknown modes {bad_modes} (known: {list(SPEC_MODES)}, with /VARIANTs)")
    records: list[dict] = []
    comparisons: list[dict] = []
    t0 = time.perf_counter()
    for target in _targets(args):
        for mode in args.modes:
            for tp in args.tp:
                with mode_environment(mode):  # a child process inherits it
                    records += (_in_child if args.isolate else run_config)(args, target, tp, mode)
                comparisons = compare(records, args.tp[0])
                _write(args.out, args, records, comparisons)
    print(f"\n{len(records)} runs in {time.perf_counter() - t0:.0f} s\n", flush=True)
    print(table(records, comparisons), flush=True)


if __name__ == "__main__":
    main()
