"""How far ahead of the GPU can the host queue CUDA graph replays before a replay call blocks?

An asynchronous run launches ~16 forwards of ~300 kernels each, then the next run's first
steps, then waits for the run's tokens. If the stream's launch queue holds fewer kernels than
that, ``graph.replay()`` blocks until the GPU has drained enough of it: the host then runs in
lock-step with the GPU and wakes for its tokens only once most of the early steps are done
(the late wake of issue 14's async runs). This probe answers with no model: graphs of K
kernels that each spin ``--kernel-us`` on the GPU (``torch.cuda._sleep``), R replays back to
back; per replay call the host's time in it and the GPU work still queued when it returned.

    python scripts/bench_launch_queue.py --kernels 50,300,1000 --replays 24 --out q.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def cycles_per_us() -> float:
    """GPU clock cycles per microsecond of ``torch.cuda._sleep`` (timed once)."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 10_000_000
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (1e3 * begin.elapsed_time(end))


def graph_of(kernels: int, cycles: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(kernels):
                torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return graph


def probe(kernels: int, replays: int, kernel_us: float, per_us: float) -> dict:
    """R replays of one graph of ``kernels`` spinning kernels, launched back to back."""
    graph = graph_of(kernels, int(kernel_us * per_us))
    graph.replay()  # first launch uploads the graph
    torch.cuda.synchronize()
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    calls, returned = [], []
    for e in ends:
        a = time.perf_counter()
        graph.replay()
        e.record()
        b = time.perf_counter()
        calls.append(1e3 * (b - a))
        returned.append(1e3 * (b - t0))
    torch.cuda.synchronize()
    gpu_end = [start.elapsed_time(e) for e in ends]  # ms since start, GPU clock
    # the GPU work still queued when each call returned: replays launched so far end at
    # gpu_end[i]; the host's clock and the GPU's share an origin within the first launch
    queued = [gpu_end[i] - returned[i] for i in range(replays)]
    graph_ms = statistics.median(b - a for a, b in zip(gpu_end, gpu_end[1:], strict=False))
    return {
        "kernels": kernels, "replays": replays, "graph_gpu_ms": graph_ms,
        "call_ms_median": statistics.median(calls), "call_ms_max": max(calls),
        "blocked_calls": sum(c > 0.5 * graph_ms for c in calls),
        "queued_ms_max": max(queued),
        "queued_kernels_max": max(queued) / graph_ms * kernels if graph_ms else None,
        "call_ms": calls, "queued_ms": queued,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", default="50,300,1000", help="kernels per graph, comma-separated")
    p.add_argument("--replays", type=int, default=24)
    p.add_argument("--kernel-us", type=float, default=10.0, help="GPU time of each kernel")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    per_us = cycles_per_us()
    results = [probe(int(k), args.replays, args.kernel_us, per_us)
               for k in args.kernels.split(",")]  # fmt: skip
    for r in results:
        print(f"{r['kernels']:5d} kernels/graph ({r['graph_gpu_ms']:.2f} ms): replay call median "
              f"{r['call_ms_median']:.3f} ms, max {r['call_ms_max']:.2f}; {r['blocked_calls']} of "
              f"{r['replays']} blocked; at most {r['queued_ms_max']:.1f} ms "
              f"(~{r['queued_kernels_max']:.0f} kernels) queued ahead")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "kernel_us": args.kernel_us, "results": results}  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
