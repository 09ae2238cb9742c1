"""Per-step orchestration cost of the Ray executor: driver -> shard workers -> driver.

overhead = (driver wall time of ``executor.execute(plan)``) - (rank 0's own ``timings.total``),
i.e. everything that is not the worker's step: plan serialisation, the hop to every rank, the
wait for the slowest rank, and the output's way back. Measured for both transports (Ray
Compiled Graph and plain ``actor.execute.remote`` + ``ray.get``) on decode steps (one verify
row of d = 0 per request) at several batch sizes, and the CPU each rank burns while idle.

    python scripts/bench_orchestration.py                      # tp=2, CPU, tiny random Llama
    python scripts/bench_orchestration.py --device cuda --model /path/to/hf_dir --tp 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from aspire_ray.engine.calibration import Sweep, SweepRunner
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.executor.ray_executor import RayExecutor
from aspire_ray.llm import build_engine_config
from aspire_ray.plan import StepPlan

TINY_LLAMA = dict(model_type="llama", hidden_size=128, intermediate_size=256,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=False)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def measure(executor: RayExecutor, runner: SweepRunner, ids: list[str], context: int,
            steps: int, warmup: int) -> dict:
    overhead, total, worker = [], [], []
    for i in range(warmup + steps):
        plan = runner.verify_plan(ids, context, 0)
        t0 = time.perf_counter()
        out = executor.execute(plan)
        wall = time.perf_counter() - t0
        if i >= warmup:
            total.append(wall)
            worker.append(out.timings.total)
            overhead.append(wall - out.timings.total)
    med_total = statistics.median(total)
    return {
        "overhead_median_ms": 1e3 * statistics.median(overhead),
        "overhead_p90_ms": 1e3 * percentile(overhead, 0.9),
        "step_median_ms": 1e3 * med_total,
        "worker_median_ms": 1e3 * statistics.median(worker),
        "overhead_fraction": statistics.median(overhead) / med_total,
    }


def idle_cores(executor: RayExecutor, seconds: float) -> list[float]:
    """CPU cores each rank burns while no step runs (a compiled graph's readers poll)."""
    executor.execute(StepPlan(0, []))  # the transport is set up and has run once
    before = executor.call_ranks("cpu_seconds")
    time.sleep(seconds)
    after = executor.call_ranks("cpu_seconds")
    return [(a - b) / seconds for a, b in zip(after, before, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy", help="HF dir / alias; 'dummy': tiny random Llama")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=128, help="tokens per request")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--transports", nargs="+", default=["plain", "compiled"])
    ap.add_argument("--idle-seconds", type=float, default=3.0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    extra = {}
    if args.model == "dummy":
        extra = dict(load_format="dummy", hf_overrides=TINY_LLAMA)
    cfg = build_engine_config(args.model, device=args.device, dtype=args.dtype,
                              tp_size=args.tp, calibrate="off",
                              num_pages=max(args.batches) * (args.context // 16 + 4) + 16,
                              max_num_seqs=max(args.batches), **extra)
    executor = RayExecutor(cfg, transport=args.transports[0])
    engine = LLMEngine(cfg, executor=executor)
    runner = SweepRunner(engine, Sweep(contexts=(args.context,), batches=tuple(args.batches)))
    ids = runner.requests(args.context, max(args.batches))
    results = []
    try:
        # batch-major, transports alternating: both see the same machine load
        for b in args.batches:
            for transport in args.transports:
                executor.set_transport(transport)
                r = measure(executor, runner, ids[:b], args.context, args.steps, args.warmup)
                r.update(transport=transport, batch=b)
                results.append(r)
                print(f"tp={args.tp} {transport:9s} batch={b:3d}  overhead median "
                      f"{r['overhead_median_ms']:6.3f} ms  p90 {r['overhead_p90_ms']:6.3f} ms  "
                      f"step {r['step_median_ms']:7.3f} ms  (worker {r['worker_median_ms']:7.3f}"
                      f" ms)  overhead fraction {100 * r['overhead_fraction']:5.1f}%",
                      flush=True)
        for transport in args.transports:
            executor.set_transport(transport)
            cores = idle_cores(executor, args.idle_seconds)
            print(f"tp={args.tp} {transport:9s} idle CPU per rank: "
                  + " ".join(f"{c:.2f}" for c in cores) + " cores", flush=True)
            results.append({"transport": transport, "idle_cores_per_rank": cores})
    finally:
        try:
            runner.release()
        finally:
            engine.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
