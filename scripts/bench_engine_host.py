"""The engine's host time a plan, on the CPU: what lies between a plan's tokens and the next
plan's launch besides the worker (docs/benchmarks.md §8.30).

1. The simulator's engine (``simulate.py``: the real scheduler, policy and cost model over a
   stand-in worker) on recorded traces, steady decode (nobody waiting): the engine's time a
   plan outside the worker (median), and the garbage collections' seconds a plan (a gc
   callback), with the heap frozen once the engine is built (``EngineConfig.gc_freeze``) and
   without.
2. A step's outputs as the driver pickles them for the replica: the full token ids of every
   request (the channel before session 23) against the new ones only.
3. Incremental detokenizing of a plan's outputs (64 requests x 8 new tokens), where the
   model's tokenizer is installed (the engine's step loop did it before session 23).

    cd scripts && python bench_engine_host.py \\
        --traces ../docs/traces_h200_qwen05b_32k_s19.json.gz \\
        --costs ../docs/bench_decode_h200_qwen05b_32k_s19.json \\
        --out ../docs/bench_engine_host_cpu_s23.json
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import random
import shlex
import statistics
import sys
import time

import simulate as sim
from traces import Traces

from aspire_ray.engine.detokenizer import DecodeState, Detokenizer
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.outputs import RequestOutput


class _Clock:
    """Engine time outside the worker, and garbage collections, in steady-decode plans."""

    def __init__(self) -> None:
        self.on, self.start, self.plans, self.host = False, 0.0, 0, []
        self.collections: list[float] = []  # seconds of each
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self.start = time.perf_counter()
        else:
            self.collections.append(time.perf_counter() - self.start)

    def wrap(self) -> None:
        clock, step = self, LLMEngine.step

        def timed(engine):
            ex = engine.executor
            if not hasattr(ex, "seconds"):
                inner, ex.seconds = ex.execute, 0.0

                def execute(plan):
                    t = time.perf_counter()
                    out = inner(plan)
                    ex.seconds += time.perf_counter() - t
                    return out
                ex.execute = execute
            decoding = any(n for k, n in engine.step_kinds.items() if k != "prefill")
            steady = decoding and not engine.scheduler.waiting
            clock.on, t0, w0 = bool(steady), time.perf_counter(), ex.seconds
            out = step(engine)
            if steady:
                clock.plans += 1
                clock.host.append(time.perf_counter() - t0 - (ex.seconds - w0))
            clock.on = False
            return out
        LLMEngine.step = timed


def engine_host(args, freeze: bool) -> dict:
    traces = Traces.load(args.traces)
    costs = sim.load_costs(args.costs, args.mode, traces.meta)
    clock = _Clock()
    clock.wrap()
    gc.unfreeze()
    for _ in range(args.runs):
        sim.simulate(traces, args.mode, costs, batch=args.batch, gc_freeze=freeze)
    gc.callbacks.remove(clock._gc)
    gc.unfreeze()
    return {"gc_freeze": freeze, "plans": clock.plans,
            "engine_host_ms_median": 1e3 * statistics.median(clock.host),
            "engine_host_ms_max": 1e3 * max(clock.host),  # a full batch's plan of many rounds
            "gc_ms_per_plan": 1e3 * sum(clock.collections) / clock.plans,
            "gc_collections": len(clock.collections),
            "gc_longest_ms": 1e3 * max(clock.collections, default=0.0)}


def channel(batch: int, tokens: int, new: int) -> dict:
    rng = random.Random(0)
    ids = [[rng.randrange(150_000) for _ in range(tokens)] for _ in range(batch)]
    out = {}
    for name, sent in (("full", ids), ("new_only", [i[-new:] for i in ids])):
        outs = [RequestOutput(f"r{r}", [], t, "", False, None, None) for r, t in enumerate(sent)]
        t0 = time.perf_counter()
        blob = [pickle.dumps(outs) for _ in range(20)][-1]
        t1 = time.perf_counter()
        for _ in range(20):
            pickle.loads(blob)
        out[name] = {"kb": len(blob) / 1e3, "pickle_ms": (t1 - t0) / 20 * 1e3,
                     "unpickle_ms": (time.perf_counter() - t1) / 20 * 1e3}
    return out


def detokenize(alias: str, batch: int, new: int, plans: int) -> dict | None:
    from transformers import AutoTokenizer

    from aspire_ray.model import registry
    try:
        tok = AutoTokenizer.from_pretrained(str(registry.resolve(alias).hf_dir))
    except Exception as e:  # noqa: BLE001 - the model's parts are not installed here
        print(f"detokenizing: skipped ({e})", file=sys.stderr)
        return None
    import pydoc_data.topics as topics

    ids = tok.encode(str(topics.topics)[:200_000])
    rng = random.Random(0)
    starts = [rng.randrange(len(ids) - new * plans) for _ in range(batch)]
    detok, states = Detokenizer(tok), [DecodeState() for _ in range(batch)]
    t0 = time.perf_counter()
    for p in range(1, plans + 1):
        for r in range(batch):
            detok.update(states[r], ids[starts[r] : starts[r] + new * p])
    return {"model": alias, "ms_per_plan": (time.perf_counter() - t0) / plans * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--traces", required=True)
    p.add_argument("--costs", required=True)
    p.add_argument("--mode", default="aspire/q4")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--runs", type=int, default=4, help="simulated batches per setting")
    p.add_argument("--tokenizer", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = {"command": shlex.join(["python", *sys.argv]),
              "engine": [engine_host(args, freeze) for freeze in (False, True)],
              "channel_768_tokens": channel(args.batch, 768, 8),
              "detokenize": detokenize(args.tokenizer, args.batch, 8, 16)}
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
