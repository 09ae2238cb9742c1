"""The host's time a plan of ``aspire``'s asynchronous runs, the worker's part included, on the
CPU: the real engine and worker over graphs that do no work.

On the GPU a plan's host work (commit, schedule, plan, launch, parse the tokens) must fit in
the GPU time of the steps started early (4 forwards, ~11.6 ms at 64 x 32k on the H200,
docs/benchmarks.md §8.31), and it grows with the batch. Here every graph replay is a no-op
and every step's argmax is 0 (so each draft is accepted): what is timed is the host alone.
Prompts are prefilled eagerly first (tiny random weights); then each steady plan's
``engine.step`` is timed, split into the worker's ``execute`` and the rest (the engine).

    python scripts/bench_plan_host.py --batch 64,256 --context 2048 --out plan_host.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import shlex
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # no GPU: kernels import under the interpreter

import torch
from bench_decode import DUMMY_SHAPES

from aspire_ray import LLM, SamplingParams
from aspire_ray.kernels.paged_attention import AttentionConfig
from aspire_ray.worker.cuda_graphs import PiecewiseGraphs
from aspire_ray.worker.step_graphs import StepGraphs


class _NoGraph:
    def replay(self) -> None:
        pass


class HostOnlyGraphs(PiecewiseGraphs):
    """Graph pieces whose self-planning steps are never run: a capture returns a no-op graph
    and an argmax buffer of the step's token bucket, fixed: zeros (every draft accepted) or
    ``tokens`` random ids (a draft matches its verification's argmax ~1/tokens of the time)."""

    tokens = 1

    def inputs_for(self, t: int, kv_caches):
        self._bucket = t
        return super().inputs_for(t, kv_caches)

    def _capture(self, n: int, kv_caches) -> None:  # the pieces are never replayed here
        self.inputs.setdefault(n, torch.zeros(3, n + n % 2, dtype=torch.int64))
        self.graphs[n] = []

    def capture_idle(self, fn, idle, kind):
        gen = torch.Generator().manual_seed(self._bucket)
        out = torch.randint(self.tokens, (self._bucket,), generator=gen, dtype=torch.long)
        return _NoGraph(), out.to(self.device)


def host_only(worker, tokens: int = 1) -> None:
    """The worker's asynchronous runs on ``HostOnlyGraphs``; other steps (prefill) eager."""
    worker.graphs = HostOnlyGraphs(worker.model, worker.backend, 4096, worker.device, _NoGraph)
    worker.graphs.tokens = tokens
    split = worker.refresh_layer if worker.selector.uses_scores else None
    worker.step_graphs = StepGraphs(worker.graphs, split, worker.max_q, 16, AttentionConfig())
    worker.async_graphs = worker._async_graphs()
    worker.graphs = None
    if worker.async_graphs is None:
        raise SystemExit("this mode has no asynchronous runs")


def run(batch: int, context: int, new: int, mode: str, profile: int, tokens: int = 1) -> dict:
    pages = -(-(context + new + 64) // 16)
    llm = LLM(model="dummy", load_format="dummy", hf_overrides=DUMMY_SHAPES["tiny-qwen3"],
              device="cpu", dtype="float32", spec_mode="aspire", max_num_seqs=batch,
              num_pages=(batch + 4) * pages, max_num_batched_tokens=8192,
              **({"verify_quantum": int(mode[1:])} if mode.startswith("q") else {}))
    engine = llm.engine
    worker = engine.executor.worker
    host_only(worker, tokens)
    rng = random.Random(0)
    vocab = engine.info.vocab_size
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [rng.randrange(vocab) for _ in range(context)], params)
    inner, spent = worker.execute, [0.0]

    def execute(plan):
        t = time.perf_counter()
        out = inner(plan)
        spent[0] += time.perf_counter() - t
        return out

    worker.execute = execute
    total, in_worker, rows = [], [], []
    prof = cProfile.Profile()
    while engine.has_unfinished():
        steady = not engine.scheduler.waiting and not any(
            r.in_prefill for r in engine.scheduler.running)
        live = len(engine.scheduler.running)
        before, t0 = spent[0], time.perf_counter()
        if steady and len(total) < profile:
            prof.enable()
        engine.step()
        prof.disable()
        if steady and live == batch:  # full batch decoding (not its ragged end)
            total.append(time.perf_counter() - t0)
            in_worker.append(spent[0] - before)
            rows.append(live)
    if not total:
        raise SystemExit("no steady plan: raise --max-tokens")
    stats = io.StringIO()
    if profile:
        pstats.Stats(prof, stream=stats).sort_stats("tottime").print_stats(40)
    engine_ms = [1e3 * (t - w) for t, w in zip(total, in_worker, strict=True)]
    return {"batch": batch, "context": context, "mode": mode, "argmax_ids": tokens,
            "plans": len(total),
            "host_ms_median": 1e3 * statistics.median(total),
            "worker_ms_median": 1e3 * statistics.median(in_worker),
            "engine_ms_median": statistics.median(engine_ms),
            "host_us_per_row": 1e3 * statistics.median(total) / batch * 1e3,
            "counters": worker.graph_counters(), "profile_top": stats.getvalue()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="64", help="comma-separated batch sizes")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens a request")
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--mode", default="q4", help="q4: verify_quantum 4 (aspire/q4); plain")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--argmax-ids", type=int, default=1,
                   help="every step's argmax drawn from this many ids: 1, every draft accepted "
                        "(the real model's high acceptance); large, almost none (random weights)")
    p.add_argument("--profile", type=int, default=0, help="plans profiled (cProfile): 0 off")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = [run(int(b), args.context, args.max_tokens, args.mode, args.profile,
                   args.argmax_ids) for b in args.batch.split(",")]  # fmt: skip
    for r in results:
        print(f"batch {r['batch']}: host {r['host_ms_median']:.2f} ms a plan (worker "
              f"{r['worker_ms_median']:.2f}, engine {r['engine_ms_median']:.2f}); "
              f"{r['host_us_per_row']:.0f} us a row; {r['plans']} plans; {r['counters']}")
        if args.profile:
            print(r["profile_top"])
    out = {"command": shlex.join(["python", *sys.argv]), "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
