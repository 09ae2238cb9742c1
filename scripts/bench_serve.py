"""The same text prompts offline (``LLM.generate``) and served (Ray Serve, OpenAI API, streaming).

Offline: one ``LLM.generate`` call over every prompt; end-to-end wall time and output tokens/s.
Served: the Serve application of ``--config`` (its engine section overridden by this script's
engine settings) started in-process on a loopback port, then ``--concurrency`` asyncio clients
stream ``POST /v1/completions`` over the same prompts. Per request: TTFT (first content chunk),
gaps between content chunks, completion tokens (from the stream's usage chunk). Reported:
p50/p90/p99 of TTFT and of the gaps, overall tokens/s, and served tokens/s / offline tokens/s.
Greedy, ``ignore_eos``: every request produces exactly ``--max-tokens`` tokens. Each path first
decodes ``WARMUP`` of the prompts for a few tokens, untimed: a fresh process pays Triton's
first-use compilation of the kernels its steps need, which a later one loads from the disk
cache (the served engine starts after the offline one). The steady-decode
window (``steady_decode``) runs from the last request's first chunk to the first request's
last: raise ``--max-tokens`` to give it more engine steps (it reports how many it had).
``--repeats N`` times each path's timed part, the LLM and the Serve application built once and
warmed up once: each path reports its ``repeats`` and, at its top level, the median wall time
and tokens/s, with the other figures (percentiles, steady decode, requests) of the repeat of
median wall time; the ratio is of the median tokens/s.

    python scripts/bench_serve.py --model smollm2-135m-instruct --device cpu --dtype float32 \
        --spec-mode aspire --num-prompts 8 --prompt-tokens 512 --max-tokens 64 \
        --concurrency 4 --out bench_serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

from local_serve import config_app_args, serve_app
from workloads import long_context_prompts

from aspire_ray import LLM, SamplingParams
from aspire_ray.serving.settings import EngineArgs

LOCAL_CONFIG = Path(__file__).resolve().parents[1] / "serve_configs" / "local.yaml"
SERVED_NAME = "bench"
PERCENTILES = (50, 90, 99)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="path or alias")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--spec-mode", default="aspire")
    p.add_argument("--engine-options", default="{}",
                   help='JSON of further engine settings, e.g. \'{"calibrate": "off"}\'')
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=512, help="about this many per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4, help="concurrent streaming clients")
    p.add_argument("--config", default=str(LOCAL_CONFIG), help="serve config to start from")
    p.add_argument("--port", type=int, default=0, help="0: a free loopback port")
    p.add_argument("--engine-driver", choices=("actor", "replica"), default="actor",
                   help="deployment.engine_driver: the engine core in a driver actor or in a "
                        "thread of the replica")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed runs of each path, one engine and one warm-up each: the median "
                        "reported, every run listed")
    p.add_argument("--out", default=None, help="JSON output path")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def engine_settings(args: argparse.Namespace) -> dict:
    """The config's engine section with this run's overrides: both paths use exactly these."""
    engine = dict(config_app_args(args.config)["engine"])
    engine.update(model=args.model, device=args.device, dtype=args.dtype,
                  spec_mode=args.spec_mode, **json.loads(args.engine_options))
    EngineArgs.model_validate(engine)  # fail here, naming the field, not inside a replica
    return engine


# untimed requests that each path decodes first (its kernels compiled, its graphs warm)
WARMUP, WARMUP_TOKENS = 2, 8


def text_prompts(llm: LLM, n: int, tokens: int) -> list[str]:
    """n text prompts of about ``tokens`` tokens (windows of the long-context document, decoded
    so that both paths tokenize the same text)."""
    tok = llm.tokenizer
    return [tok.decode(ids) for ids in long_context_prompts(tok, n, tokens)]


def percentiles(values: list[float]) -> dict[str, float]:
    """Nearest-rank p50/p90/p99 in milliseconds (zeros when there are no values)."""
    s = sorted(values)
    if not s:
        return {f"p{q}_ms": 0.0 for q in PERCENTILES}
    return {f"p{q}_ms": 1e3 * s[min(len(s) - 1, max(0, -(-q * len(s) // 100) - 1))]
            for q in PERCENTILES}


def offline_kwargs(engine: dict) -> dict:
    """``LLM(...)`` keywords of the engine settings: the EngineConfig a replica builds from the
    same settings (``EngineArgs.to_engine_config``), as tests/serving/test_bench_serve.py checks."""
    flat = {k: v for k, v in EngineArgs.model_validate(engine).model_dump().items()
            if v is not None and k != "spec_options"}
    return {**flat, **engine.get("spec_options", {})}


def with_medians(repeats: list[dict]) -> dict:
    """One path's result: the figures of its median-wall repeat (the lower middle one for an
    even count) with the median wall_s and tokens_per_s over all, and ``repeats``: every
    repeat's figures, less its per-request list."""
    middle = sorted(repeats, key=lambda r: r["wall_s"])[(len(repeats) - 1) // 2]
    return {**middle, "wall_s": statistics.median(r["wall_s"] for r in repeats),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in repeats),
            "median_repeat": repeats.index(middle),
            "repeats": [{k: v for k, v in r.items() if k != "requests"} for r in repeats]}


def offline_counters(llm: LLM) -> tuple[float, ...]:
    """``engine_counters``' figures of an in-process engine (its ``stats()``, which the served
    path's /metrics are made of)."""
    stats = llm.stats()
    timings = stats.get("timings", {})
    breakdown = {f"phase {k} s": v for k, v in timings.items() if k != "total"}
    for kind, n in stats.get("step_kinds", {}).items():
        breakdown[f"{kind} steps"] = float(n)
        breakdown[f"{kind} s"] = stats.get("step_seconds", {}).get(kind, 0.0)
    return (float(stats.get("steps", 0)), sum(stats.get("step_seconds", {}).values()),
            sum(timings.get(k, 0.0) for k in ("schedule", "execute", "commit")),
            float(stats.get("pages_total", math.nan)), breakdown)


def engine_figures(start: tuple, end: tuple, wall: float) -> dict:
    """The engine over one timed run, from its counters at both ends: steps, their worker and
    whole (scheduling, worker, commit) seconds, and the fraction of the run's wall time it
    spent in steps. Served against offline, a lower fraction is an engine waiting for work
    (prompts reaching it late), a longer step a step made slower (issue 16); and its KV pool
    in pages (a pool too small for the batch admits requests late: their TTFTs)."""
    steps, worker, whole = (b - a for a, b in zip(start[:3], end[:3], strict=True))
    return {"steps": steps, "worker_s": worker, "step_wall_s": whole,
            "step_ms": 1e3 * whole / steps if steps > 0 else math.nan,
            "busy_frac": whole / wall if wall > 0 else math.nan, "kv_pages": end[3],
            # where the steps' time went: steps and worker seconds by step kind, and the
            # seconds of each phase (schedule / execute / commit; the worker's prepare,
            # forward, sample, refresh): the two paths side by side name what differs
            "breakdown": {k: v - start[4].get(k, 0.0) for k, v in sorted(end[4].items())}}


def timed_generate(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[dict, list]:
    """One timed ``LLM.generate`` over every prompt: (its figures, the prompts' token counts)."""
    c0 = offline_counters(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return ({"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
             "engine": engine_figures(c0, offline_counters(llm), wall)},
            [len(o.prompt_token_ids) for o in outs])


def run_offline(engine: dict, args: argparse.Namespace) -> tuple[list[str], dict]:
    """(the text prompts, offline results over ``--repeats`` timed runs); the LLM is released
    before Serve starts."""
    with LLM(**offline_kwargs(engine)) as llm:
        prompts = text_prompts(llm, args.num_prompts, args.prompt_tokens)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts[:WARMUP], SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0,
                                                      ignore_eos=True))  # fmt: skip
        runs = [timed_generate(llm, prompts, params) for _ in range(args.repeats)]
    return prompts, {**with_medians([r for r, _ in runs]), "prompt_tokens": runs[0][1]}


async def stream_one(client, url: str, prompt: str, max_tokens: int, started: list[int],
                     total: int, all_started: asyncio.Event) -> dict:  # fmt: skip
    """One streaming completion: TTFT, gaps between content chunks (and their arrival times),
    completion tokens. started[0] counts requests with a first chunk; all_started is set when
    it reaches total."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals, usage, finish = [], None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) == 1:
                        started[0] += 1
                        if started[0] == total:
                            all_started.set()
                finish = choice.get("finish_reason") or finish
    end = time.perf_counter()
    return {"ttft_s": arrivals[0] - t0 if arrivals else end - t0, "arrivals": arrivals,
            "gaps_s": [b - a for a, b in zip(arrivals[:-1], arrivals[1:], strict=True)],
            "completion_tokens": usage["completion_tokens"] if usage else len(arrivals),
            "finish_reason": finish, "latency_s": end - t0}


COUNTERS = ("steps", "step_seconds", "step_wall_seconds")


async def engine_counters(client, url: str) -> tuple[float, ...]:
    """(engine steps, their worker seconds, their wall seconds, KV pool pages) from the
    server's /metrics."""
    text = (await client.get(f"{url}/metrics")).text
    names = [f"aspire_engine_{name}_total" for name in COUNTERS] + ["aspire_kv_pages_total"]
    found = {name: float(m.group(1)) for name in names
             if (m := re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M))}
    breakdown = {}  # offline_counters' names for the labelled families
    for family, label, name in (("steps_by_kind", "kind", "{} steps"),
                                ("step_seconds_by_kind", "kind", "{} s"),
                                ("phase_seconds", "phase", "phase {} s")):
        for m in re.finditer(rf'^aspire_engine_{family}_total{{[^}}]*{label}="([^"]+)"[^}}]*}} '
                             rf"(\S+)$", text, re.M):
            breakdown[name.format(m.group(1))] = float(m.group(2))
    return (*(found.get(name, math.nan) for name in names), breakdown)


def steady_decode(results: list[dict], start: tuple, end: tuple) -> dict:
    """Steady decode: from the moment every request has its first chunk (all prompts
    prefilled) to the first request's end (the batch is whole throughout), each a (time,
    engine counters) pair: the gaps between chunks there, and the engine's worker time a step
    (a plan) over the same span, read from /metrics at both ends; issue 16 asks the gaps' p50
    <= 1.2x that. Also the engine's whole step (scheduling and commit too, which the offline
    engine pays alike): the gap over it is what the serving path alone adds."""
    (t0, c0), (t1, c1) = start, end
    gaps = [b - a for r in results for a, b in zip(r["arrivals"][:-1], r["arrivals"][1:],
                                                  strict=True) if t0 <= a and b <= t1]  # fmt: skip
    steps, seconds, wall = (b - a for a, b in zip(c0[:3], c1[:3], strict=True))
    step_ms = 1e3 * seconds / steps if steps > 0 else math.nan
    wall_ms = 1e3 * wall / steps if steps > 0 else math.nan
    gap = percentiles(gaps)
    return {"gaps": len(gaps), "window_s": t1 - t0, "inter_chunk": gap, "engine_steps": steps,
            "engine_step_ms": step_ms, "gap_p50_over_step": gap["p50_ms"] / step_ms,
            "engine_step_wall_ms": wall_ms, "gap_p50_over_step_wall": gap["p50_ms"] / wall_ms}


async def run_clients(url: str, prompts: list[str], args: argparse.Namespace) -> dict:
    """The warm-up requests, then ``--repeats`` timed client runs (``client_run``) on one HTTP
    client: the served result (``with_medians``)."""
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(stream_one(client, url, p, WARMUP_TOKENS, [0], WARMUP,
                                          asyncio.Event()) for p in prompts[:WARMUP]))
        repeats = [await client_run(client, url, prompts, args) for _ in range(args.repeats)]
    return with_medians(repeats)


async def client_run(client, url: str, prompts: list[str], args: argparse.Namespace) -> dict:
    """One timed run: ``--concurrency`` clients drain a shared queue of the prompts; with one
    client a prompt, the steady-decode figures (``steady_decode``) too."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[dict] = []
    all_started, first_done = asyncio.Event(), asyncio.Event()
    started = [0]
    marks: list[tuple] = []  # (time, engine counters) at all_started, then at first_done

    async def client_loop(client) -> None:
        while not queue.empty():
            results.append(await stream_one(client, url, queue.get_nowait(), args.max_tokens,
                                            started, len(prompts), all_started))
            if not first_done.is_set():
                first_done.set()
                if len(marks) == 1:  # the window's end, before more requests end
                    marks.append((time.perf_counter(), await engine_counters(client, url)))

    steady = args.concurrency >= len(prompts)
    c0 = await engine_counters(client, url)
    t0 = time.perf_counter()
    clients = asyncio.gather(*(client_loop(client) for _ in range(args.concurrency)))
    if steady:  # a failing client must not leave this waiting for the rest to start
        waiter = asyncio.ensure_future(all_started.wait())
        await asyncio.wait({waiter, clients}, return_when=asyncio.FIRST_COMPLETED)
        if all_started.is_set():
            marks.append((time.perf_counter(), await engine_counters(client, url)))
        waiter.cancel()
    await clients
    wall = time.perf_counter() - t0
    if len(marks) == 1:  # a request ended before the last one started: an empty window
        marks.append(marks[0])
    figures = run_figures(results, wall, marks, args.concurrency)
    figures["engine"] = engine_figures(c0, await engine_counters(client, url), wall)
    return figures


def run_figures(results: list[dict], wall: float, marks: list[tuple], concurrency: int) -> dict:
    """One timed client run's figures from its requests (``stream_one``'s results)."""
    tokens = sum(r["completion_tokens"] for r in results)
    out = {"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall,
           "concurrency": concurrency,
           "ttft": percentiles([r["ttft_s"] for r in results]),
           "inter_chunk": percentiles([g for r in results for g in r["gaps_s"]])}
    if len(marks) == 2:
        out["steady_decode"] = steady_decode(results, *marks)
    out["requests"] = [{k: v for k, v in r.items() if k not in ("gaps_s", "arrivals")}
                       for r in results]  # fmt: skip
    return out


def run_served(engine: dict, prompts: list[str], args: argparse.Namespace) -> dict:
    """Start the config's application with ``engine`` in-process, stream, shut everything down."""
    app_args = config_app_args(args.config)
    app_args["engine"] = engine
    app_args["server"]["served_model_name"] = SERVED_NAME
    deployment = app_args.setdefault("deployment", {})
    deployment["engine_driver"] = args.engine_driver
    if args.engine_driver == "replica" and engine.get("device", "cpu").startswith("cuda"):
        deployment["ray_actor_options"] = {"num_cpus": 1, "num_gpus": 1}  # it holds the GPU
    with serve_app(app_args, args.port) as url:
        return asyncio.run(run_clients(url, prompts, args))


def table_row(label: str, r: dict) -> str:
    """A table row of one repeat's figures, or of a path's (median) result."""
    pct = {key: "/".join(f"{r[key][f'p{q}_ms']:.{digits}f}" for q in PERCENTILES)
           if key in r else "" for key, digits in (("ttft", 0), ("inter_chunk", 1))}  # fmt: skip
    eng = r.get("engine")
    busy = f"{eng['steps']:.0f} / {eng['step_ms']:.1f} / {100 * eng['busy_frac']:.0f}% / " \
        f"{eng.get('kv_pages', math.nan):.0f}" if eng else ""  # fmt: skip
    return (f"| {label} | {r['wall_s']:.2f} | {r['output_tokens']} | {r['tokens_per_s']:.1f} "
            f"| {pct['ttft']} | {pct['inter_chunk']} | {busy} |")


def path_rows(label: str, r: dict) -> list[str]:
    """A path's rows: one a repeat, then the median (a single repeat: one row)."""
    if len(r["repeats"]) == 1:
        return [table_row(label, r)]
    return [*(table_row(f"{label} #{i + 1}", rep) for i, rep in enumerate(r["repeats"])),
            table_row(f"{label} median", r)]


def table(result: dict) -> str:
    off, srv = result["offline"], result["served"]
    rows = ["| path | wall s | tokens | tokens/s | TTFT p50/p90/p99 ms | gap p50/p90/p99 ms "
            "| engine steps / ms a step / busy / KV pages |",
            "|---|---|---|---|---|---|---|", *path_rows("offline", off),
            *path_rows(f"served x{srv['concurrency']}", srv)]
    rows.append(f"\nserved / offline tokens/s (medians): {result['ratio']:.3f}")
    if "steady_decode" in srv:
        sd = srv["steady_decode"]
        rows.append(f"steady decode (served #{srv['median_repeat'] + 1}): gap p50 "
                    f"{sd['inter_chunk']['p50_ms']:.1f} ms, engine "
                    f"{sd['engine_step_ms']:.1f} ms a step ({sd['engine_steps']:.0f} steps): "
                    f"{sd['gap_p50_over_step']:.2f}x; whole engine step "
                    f"{sd['engine_step_wall_ms']:.1f} ms: {sd['gap_p50_over_step_wall']:.2f}x")
    rows += ["", *breakdown_table(off["engine"], srv["engine"])]
    return "\n".join(rows)


def breakdown_table(off: dict, srv: dict) -> list[str]:
    """The two paths' engine breakdowns (median repeats) side by side: what the served engine
    spends more on, by step kind and phase."""
    a, b = off.get("breakdown", {}), srv.get("breakdown", {})
    rows = ["| engine (median run) | offline | served | served - offline |", "|---|---|---|---|"]
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key, 0.0), b.get(key, 0.0)
        fmt = "{:.0f}" if key.endswith("steps") else "{:.3f}"
        rows.append(f"| {key} | {fmt.format(x)} | {fmt.format(y)} | {fmt.format(y - x)} |")
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    engine = engine_settings(args)
    prompts, offline = run_offline(engine, args)
    served = run_served(engine, prompts, args)
    result = {"command": shlex.join(["python", *sys.argv]), "args": vars(args), "engine": engine,
              "offline": offline, "served": served,  # medians over --repeats, and each repeat
              "ratio": served["tokens_per_s"] / offline["tokens_per_s"]}
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
