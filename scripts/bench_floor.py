"""Each decode step kind against its memory floor, from one run on one device.

Per mode and step kind (ar, draft, verify, mixed draft+verify): the median wall time of
``engine.step()`` and the worker's prepare / forward / refresh / sample split; the bytes the step
must read (every weight once, the embedding table only for its gathered rows, and the KV pages
each row lists in each layer: a draft row its sparse list, all of its pages in the refresh layer
of a scoring policy; other rows all their pages); the copy bandwidth measured in this run; floor
= bytes / bandwidth, ratio = measured / floor; and the GPU's idle time per step from a
torch.profiler trace (wall time minus the union of its kernel and copy intervals).

    python scripts/bench_floor.py --dummy-shapes qwen2.5-coder-0.5b --context 32000 \
        --batch 64 --modes ar,magicdec,aspire_fixed,aspire --out floor.json --plot floor.png

Run it from anywhere; it imports its siblings in scripts/ (bench_decode, workloads, floor_report).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import shlex
import sys
import time

import torch
from bench_decode import (
    DUMMY_SHAPES,
    _empty_cache,
    _worker_call,
    mode_environment,
    mode_options,
    prefill_batch,
    random_prompts,
)
from floor_report import (
    SPLIT,
    Row,
    async_run_rows,
    clock_summary,
    draft_slopes,
    gap_borders,
    graph_kinds_table,
    graph_ratios,
    host_at_gaps,
    idle_gaps,
    idle_per_step,
    kv_page_reads,
    long_gaps,
    median,
    page_bytes,
    ratios_table,
    slopes_table,
    step_kind,
    summarize,
    table,
    weight_bytes,
)
from workloads import long_context_prompts

from aspire_ray import LLM, SamplingParams
from aspire_ray.config import SpecConfig
from aspire_ray.model.arch import ModelArch
from aspire_ray.worker.model_loading import hf_weight_shapes, load_hf_config

STEP_LABEL = "bench_floor.step"  # the profiler's annotation around each engine step
PY_FUNCTION = re.compile(r"\.py\(\d+\): |^<built-in ")  # a Python function's profiler event


class Recorder:
    """The engine's executor, wrapped: keeps each step's rows and the worker's timings (the
    engine itself keeps only sums per step kind, and no row lengths)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.steps: list[tuple[list[Row], dict[str, float]]] = []

    def execute(self, plan):
        out = self.inner.execute(plan)
        runs = [r for r in plan.rows if r.async_gamma is not None]
        rounds = [r for r in plan.rows if r.async_gamma is None]
        rows = [
            Row(r.kind.name.lower(), r.context_len, r.num_tokens, r.num_drafts, r.num_steps,
                r.verify_after is not None, r.num_rounds)
            for r in rounds
        ]
        # a round's verification (after the chain, in the same plan), with placeholder drafts
        rows += [
            Row("verify", v.context_len, v.num_tokens, v.num_drafts, 1, True, r.num_rounds)
            for r, v in ((r, r.verify_row([0] * r.num_steps)) for r in rounds if r.verify_after)
        ]
        # an asynchronous run: each row's steps, known from its drafts held and its gamma
        for r in runs:
            rows += async_run_rows(r.context_len, r.async_kinds())
        self.steps.append((rows, out.timings.as_dict()))
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> dict:
    """Device-to-device copy of nbytes, median of repeats; counts read + write (2 * nbytes)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    cuda = device.type == "cuda"
    times = []
    for _ in range(repeats + 2):  # two warm-ups
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    t = median(times[2:])
    return {
        "copy_bytes": nbytes,
        "repeats": repeats,
        "seconds_median": t,
        "bytes_per_s": 2 * nbytes / t,
        "seconds_all": times[2:],
        "counts": "read + write: bandwidth = 2 * copy_bytes / seconds",
    }


class StepBytes:
    """Bytes a step must read, from the model's config and the engine's spec config."""

    def __init__(self, engine, elem: int) -> None:
        arch = ModelArch.from_hf_config(load_hf_config(engine.cfg))
        self.arch, self.elem, self.spec = arch, elem, engine.cfg.spec
        self.shapes = hf_weight_shapes(arch)
        self.page_size = engine.cfg.cache.page_size
        self.page = page_bytes(self.page_size, arch.num_kv_heads, arch.head_dim, elem)

    def __call__(self, rows: list[Row]) -> dict[str, int]:
        if any(r.run_step >= 0 for r in rows):  # an asynchronous run: each step's own rows
            steps = [[r._replace(run_step=-1) for r in rows if r.run_step == i]
                     for i in range(max(r.run_step for r in rows) + 1)]  # fmt: skip
            per_step = [self(step) for step in steps]
            # a step's mean, as its wall time is (run_mode: the plan's over its steps)
            return {key: sum(b[key] for b in per_step) / len(per_step) for key in per_step[0]}
        if any(r.in_round for r in rows):  # k draft steps, then the verify step
            drafts = [r._replace(in_round=False) for r in rows if r.kind == "draft"]
            verifies = [r._replace(in_round=False) for r in rows if r.kind == "verify"]
            k = max(r.num_steps for r in drafts)
            a, b = self(drafts), self(verifies)
            return {key: k * a[key] + b[key] for key in a}
        w = weight_bytes(self.shapes, sum(r.num_tokens for r in rows), self.elem)
        reads = kv_page_reads(
            rows,
            self.arch.num_layers,
            self.page_size,
            self.spec.sparse_budget,
            self.spec.refresh_while_drafting,
        )
        return {"weights": w, "kv": reads * self.page, "total": w + reads * self.page}


def gpu_idle(engine, rec: Recorder, steps: int, stacks: bool = False) -> list[dict]:
    """Profile `steps` engine steps: per step its window (start to next start), the union of
    the GPU's kernel / memcpy / memset intervals inside it, and the idle rest. stacks: also
    record the host's Python functions and charge each long idle gap to what the host was
    running meanwhile (``gap_hosts``; printed)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    first, ran = len(rec.steps), []
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, with_stack=stacks) as prof:
        for _ in range(steps):
            before = len(rec.steps)
            with record_function(STEP_LABEL):
                engine.step()
            ran.append(len(rec.steps) > before)  # a step with no rows never reaches the worker
        torch.cuda.synchronize()
    events = prof.profiler.kineto_results.events()
    marks = sorted(
        (e.start_ns(), e.end_ns())
        for e in events
        if e.name() == STEP_LABEL and e.device_type() == torch.autograd.DeviceType.CPU
    )
    # device events, without the GPU-side copies of the annotations (they span whole steps)
    device = [
        (e.start_ns(), e.end_ns(), e.name())
        for e in events
        if e.device_type() == torch.autograd.DeviceType.CUDA
        and e.name() != STEP_LABEL
        and not e.is_user_annotation()
    ]
    busy = [(s, e) for s, e, _ in device]
    bounds = [*(s for s, _ in marks), marks[-1][1]]
    gaps = [idle_gaps(busy, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
    windows = idle_per_step([s for s, _ in marks], marks[-1][1], busy)
    kinds = iter((step_kind(rows), chain_steps(rows)) for rows, _ in rec.steps[first:])
    step_kinds = [next(kinds) if r else (None, 1) for r in ran]
    kernels = kernel_times(events, [s for s, _ in marks], step_kinds)
    if stacks:  # a diagnosis: its failure must not lose the run's figures
        try:
            gap_hosts(events, device, bounds, sum(k for kind, k in step_kinds if kind is not None))
        except Exception as e:  # noqa: BLE001
            print(f"## host during GPU idle gaps: not reported ({e!r})", file=sys.stderr)
    windows = [w for w, r in zip(windows, ran, strict=True) if r]
    gaps = [g for g, r in zip(gaps, ran, strict=True) if r]
    out = []
    for (rows, _), (window, b), g in zip(rec.steps[first:], windows, gaps, strict=True):
        kind, k = step_kind(rows), chain_steps(rows)
        out.append({"kind": kind, "window_s": window / 1e9 / k, "busy_s": b / 1e9 / k,
                    "kernels": kernels.get(kind, {}),
                    # per step of the plan: idle gaps <= 2 us, <= 10 us, <= 100 us, longer
                    "idle_gaps": [{"count": n / k, "ms": t / 1e6 / k} for n, t in g]})
    return out


def gap_hosts(events, device: list[tuple[int, int, str]], bounds: list[int], steps: int) -> None:
    """Print what the host ran while the GPU sat idle for over 100 us in the profiled steps
    (device: the GPU's work, (start, end, name)): per Python function or CUDA runtime call
    (innermost, the main thread), ms per decode step; the same over this repository's
    functions only; the kernels on either side of the gaps."""
    main = {e.start_thread_id() for e in events if e.name() == STEP_LABEL
            and e.device_type() == torch.autograd.DeviceType.CPU}  # fmt: skip
    host = [e for e in events if e.device_type() == torch.autograd.DeviceType.CPU
            and (is_python_function(e) or e.name().startswith("cuda"))]  # fmt: skip
    mine = [e for e in host if e.start_thread_id() in main] or host
    spans = [(e.start_ns(), e.end_ns(), e.name()[:100]) for e in mine]
    busy = [(s, e) for s, e, _ in device]
    gaps = [g for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
            for g in long_gaps(busy, lo, hi)]  # fmt: skip
    total = sum(g1 - g0 for g0, g1 in gaps)
    print(f"## host during GPU idle gaps > 100 us: {len(gaps)} gaps, "
          f"{total / 1e6 / max(steps, 1):.3f} ms per decode step", file=sys.stderr)
    ours = [sp for sp in spans if "aspire_ray/" in sp[2] or "scripts/" in sp[2]]
    for title, chosen in (("innermost", spans), ("innermost of this repository's", ours)):
        print(f"# {title} functions, ms per decode step", file=sys.stderr)
        for name, ns in list(host_at_gaps(gaps, chosen).items())[:25]:
            print(f"{ns / 1e6 / max(steps, 1):8.3f}  {name}", file=sys.stderr)
    print("# GPU work before and after the gaps (gaps: kernel before -> kernel after)",
          file=sys.stderr)  # fmt: skip
    for (before, after), n in list(gap_borders(gaps, device).items())[:12]:
        print(f"{n:5d}  {before[:60]} -> {after[:60]}", file=sys.stderr)


def is_python_function(event) -> bool:
    """A profiler event of a Python function ("path.py(line): name"; torch 2.11's events have no
    ``is_python_function``)."""
    test = getattr(event, "is_python_function", None)
    return test() if test is not None else PY_FUNCTION.search(event.name()) is not None


def new_tokens(args) -> int:
    """Output tokens per request that outlast the run: every engine step (a round of draft
    chain + verification commits up to gamma + 1 tokens, rounds_per_plan of them in one plan;
    an ar decode chain ar_chain tokens) plus a verification, at the largest gamma and
    rounds_per_plan of the run's modes (their ``/gN``, ``rN``, ``aN`` variants)."""
    plans = args.warmup + args.steps + args.profile_steps + args.cprofile
    spec, per_plan = SpecConfig(), 1
    for mode in args.modes.split(","):
        o = mode_options(mode)[1]
        per_plan = max(per_plan, (o.get("gamma", spec.gamma) + 1)
                       * o.get("rounds_per_plan", spec.rounds_per_plan),
                       o.get("ar_chain", spec.ar_chain))  # fmt: skip
    return plans * per_plan + max(spec.d_max, *(mode_options(m)[1].get("d_max", 0)
                                                for m in args.modes.split(","))) + 2


def sampling_params(args) -> SamplingParams:
    """Every request's: greedy, or sampled with --temperature / --top-p / --top-k (seeded).
    The floor counts no bytes for sampling: its logits and probabilities are activations (at
    64 rows of a 152k vocabulary ~3% of a draft step's floor), so a sampled step's ratio above
    the greedy one is what the sampling costs. No request finishes within the run (a round,
    one plan, commits up to gamma + 1 tokens)."""
    return SamplingParams(max_tokens=new_tokens(args), temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=0, ignore_eos=True)


def chain_steps(rows) -> int:
    """Decode steps one plan stands for: a draft chain's steps (RowPlan.num_steps), else 1 (a
    round, chain and verification, is one step of its own kind; a plan of several rounds
    stands for that many)."""
    if any(r.in_round for r in rows):
        return max(r.rounds for r in rows)
    if any(r.run_step >= 0 for r in rows):  # an asynchronous run
        return max(r.run_step for r in rows) + 1
    return max((r.num_steps for r in rows), default=1)


def kernel_times(events, starts: list[int], kinds: list[tuple[str | None, int]]) -> dict:
    """GPU time per kernel name and step kind, per step of that kind: kind -> {name: us}.
    kinds: per engine step, its kind and the decode steps it stands for (a draft chain)."""
    import bisect

    total: dict[str, dict[str, float]] = {}
    for e in events:
        if e.device_type() != torch.autograd.DeviceType.CUDA or e.is_user_annotation():
            continue
        i = bisect.bisect_right(starts, e.start_ns()) - 1
        if i < 0 or kinds[i][0] is None or e.name() == STEP_LABEL:
            continue
        by_name = total.setdefault(kinds[i][0], {})
        by_name[e.name()[:80]] = by_name.get(e.name()[:80], 0.0) + (e.end_ns() - e.start_ns()) / 1e3
    steps = {k: sum(n for kind, n in kinds if kind == k) for k in total}
    return {k: dict(sorted(((n, us / steps[k]) for n, us in v.items()), key=lambda x: -x[1]))
            for k, v in total.items()}  # fmt: skip


def run_mode(mode: str, args, extra: dict, bandwidth: float) -> dict:
    kw = {"model": args.model, **extra}  # dummy shapes: model="dummy" and its overrides
    spec_mode, options = mode_options(mode)
    llm = LLM(
        device=args.device,
        dtype=args.dtype,
        spec_mode=spec_mode,
        **options,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_batched_tokens,
        calibrate=args.calibrate,
        **kw,
    )
    engine = llm.engine
    rec = Recorder(engine.executor)
    engine.executor = rec
    vocab = engine.info.vocab_size
    prompts = (
        random_prompts(args.batch, args.context, vocab)
        if args.dummy_shapes
        else long_context_prompts(llm.tokenizer, args.batch, args.context)
    )
    params = sampling_params(args)
    prefill_batch(engine, prompts, params, mode)
    for _ in range(args.warmup):  # graph buckets, kernel compiles, the pool's first pages
        engine.step()
    rec.steps.clear()
    on_gpu = torch.device(args.device).type == "cuda"
    if on_gpu:  # every graph replay timed on the GPU, by its step kind (graph_clock.py)
        _worker_call(engine, "graph_clock", True)
    walls = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        if len(rec.steps) > len(walls):  # a step with no rows never reaches the worker
            walls.append(time.perf_counter() - t0)
    clock = clock_summary(_worker_call(engine, "graph_clock", False)) if on_gpu else None
    count_bytes = StepBytes(engine, torch.empty(0, dtype=getattr(torch, args.dtype)).element_size())
    steps = [
        {
            "kind": step_kind(rows),
            "chain": chain_steps(rows),
            "wall_s": w / chain_steps(rows),
            "rows": sum(1 for r in rows if r.run_step <= 0),  # an asynchronous run's: per step
            "tokens": sum(r.num_tokens for r in rows),
            "bytes": count_bytes(rows),
            "worker_s": {k: t[k] / chain_steps(rows) for k in SPLIT if k in t},
        }
        for (rows, t), w in zip(rec.steps, walls, strict=True)
    ]
    if args.cprofile:
        host_profile(engine, args.cprofile, mode)
    idle = gpu_idle(engine, rec, args.profile_steps, args.gap_hosts) \
        if on_gpu and args.profile_steps else None  # fmt: skip
    for kind, names in {p["kind"]: p["kernels"] for p in idle or []}.items():
        print(f"## GPU time per {kind} step by kernel ({mode}), us", file=sys.stderr)
        for name, us in list(names.items())[:16]:
            print(f"{us:9.1f}  {name}", file=sys.stderr)
    llm.shutdown()
    del llm, engine
    gc.collect()
    _empty_cache()
    kinds = summarize(steps, idle, bandwidth)
    for kind, k in kinds.items():
        for g in k.get("gpu", {}).get("idle_gaps", []):
            bucket = f"<= {g['upto_us']:g} us" if g["upto_us"] else "longer"
            print(f"{mode} {kind}: idle gaps {bucket}: {g['count']:.0f} per step, "
                  f"{g['ms']:.3f} ms", file=sys.stderr)  # fmt: skip
    # each mode's replays at once, so that a call cut before the report keeps them
    for kind, k in (clock["by_kind"] if clock else {}).items():
        print(f"{mode} graph {kind}: {k['replays']} replays, median {k['median_ms']:.3f} ms, "
              f"mean {k['mean_ms']:.3f} ms", file=sys.stderr)  # fmt: skip
    return {"mode": mode, "kinds": kinds, "steps": steps, "profile": idle,
            "graph_kinds": clock["by_kind"] if clock else {}}  # fmt: skip


def host_profile(engine, steps: int, mode: str) -> None:
    """Print the host functions that take a step's time (cProfile over ``steps`` steps)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    print(f"## host profile: {mode}, {steps} steps (seconds summed over them)", file=sys.stderr)
    stats = pstats.Stats(prof, stream=sys.stderr)
    stats.sort_stats("tottime").print_stats(22)
    stats.sort_stats("cumulative").print_stats(30)


def plot(results: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    bars = [
        (f"{r['mode']}\n{kind}", k["wall_ms"], k["floor_ms"])
        for r in results
        for kind, k in r["kinds"].items()
    ]
    x = range(len(bars))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(bars)), 4))
    ax.bar([i - 0.2 for i in x], [b[1] for b in bars], 0.4, label="measured (median wall)")
    ax.bar([i + 0.2 for i in x], [b[2] for b in bars], 0.4, label="floor = bytes / copy bw")
    ax.set_xticks(list(x), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="path or alias")
    p.add_argument(
        "--dummy-shapes",
        choices=sorted(DUMMY_SHAPES),
        default=None,
        help="random weights of this architecture, random-token prompts",
    )
    p.add_argument("--context", type=int, default=8000, help="prompt tokens per request")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--modes", default="ar,magicdec,aspire_fixed,aspire",
                   help="spec modes; MODE/VARIANT (bench_decode.VARIANTS): e.g. magicdec/nochain")
    p.add_argument("--steps", type=int, default=60, help="timed decode steps per mode")
    p.add_argument("--warmup", type=int, default=8, help="untimed decode steps first")
    p.add_argument("--profile-steps", type=int, default=12, help="profiled steps (GPU only)")
    p.add_argument("--cprofile", type=int, default=0, help="steps under cProfile (stderr)")
    p.add_argument("--gap-hosts", action="store_true",
                   help="profile with Python stacks: what the host ran in each long GPU idle "
                        "gap (stderr; GPU only)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature > 0")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature > 0 (0: off)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-batched-tokens", type=int, default=16384)
    p.add_argument("--calibrate", default="auto", choices=("auto", "off", "force"))
    p.add_argument("--copy-mib", type=int, default=None, help="default 1024 (cuda), 64 (cpu)")
    p.add_argument("--copy-repeats", type=int, default=10)
    p.add_argument("--out", default=None, help="JSON report")
    p.add_argument("--plot", default=None, help="PNG: measured vs floor per step kind")
    args = p.parse_args()
    device = torch.device(args.device)
    mib = args.copy_mib or (1024 if device.type == "cuda" else 64)
    bw = copy_bandwidth(device, mib * 2**20, args.copy_repeats)  # before the KV pool is taken
    _empty_cache()
    extra = {}
    if args.dummy_shapes:  # a pool of just the batch's pages (16-token pages, the default)
        tokens = args.context + new_tokens(args) + 64
        extra = dict(
            model="dummy",
            load_format="dummy",
            hf_overrides=DUMMY_SHAPES[args.dummy_shapes],
            num_pages=(args.batch + 4) * -(-tokens // 16),
        )
    results = []
    for mode in args.modes.split(","):
        with mode_environment(mode):  # its kernel switches (bench_decode.ENV_VARIANTS)
            results.append(run_mode(mode, args, extra, bw["bytes_per_s"]))
        print(f"{mode} done", file=sys.stderr, flush=True)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    what = args.dummy_shapes or args.model
    print(
        f"# Step floors: {what}, context {args.context}, batch {args.batch}, {args.dtype}, "
        f"{gpu}, torch {torch.__version__}, triton {triton_version}"
    )
    print(table(results, bw))
    if any(r["graph_kinds"] for r in results):  # the steps as they run in their plans
        print()
        print(graph_kinds_table(results, args.batch))
    slopes = draft_slopes(results)
    if slopes:  # modes at two gammas: their draft step alone
        print()
        print(slopes_table(slopes))
    ratios = graph_ratios(results)
    if ratios:  # the round modes' draft and verify graphs against `ar`'s, on the GPU's clock
        print()
        print(ratios_table(ratios))
    if device.type != "cuda":
        print("\nGPU idle: not measured on the CPU (the profiler part runs on CUDA only)")
    report = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "args": vars(args),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "bandwidth": bw,
        "results": results,
        "draft_slopes": slopes,
        "graph_ratios": ratios,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if args.plot:
        plot(results, args.plot, f"{what}, ctx {args.context}, batch {args.batch}, {gpu}")


if __name__ == "__main__":
    main()
