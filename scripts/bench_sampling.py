"""The sampling kernels (``kernels/race.py``, ``top_k_top_p.py``) against their torch references.

For each row count (a draft step's batch, a verification's batch x (gamma + 1) rows), vocab
151,936 (Qwen2.5), temperature 0.7, side by side in one run:
- filter: ``probs_from_logits`` (Triton, no sort: ``filter_probs``'s searches) against
  ``probs_from_logits_ref`` (torch sort), with top-k 20 and top-p 0.8, and top-p 0.8 alone,
  for each search width ``--ways`` and number of passes over whole rows before the candidates
  are compacted (``--full-passes``; "WAYSxFULL" in the JSON), and an older filter beside it
  (``--baseline-filter FILE``);
- draw: ``sample_from_probs`` (Triton race) against ``race_ref`` on the filtered rows, and the
  race alone on unfiltered rows (every weight above 0), and an older race beside it
  (``--baseline-race FILE``);
- the check: the same support, max abs difference of the probabilities, the same draws;
- accept: a sampled verification's acceptance test (``verify_sampled_batch``, eager, to host
  tokens) of ``--accept-rows`` rows of ``--gamma`` drafts;
- choices: an asynchronous step's ``sampled_choices`` (``--accept-rows`` rows, one in
  ``--verify-every`` verifying ``--gamma`` drafts, the rest drafting; bf16 logits) on the GPU
  path (``kernels/choice_rows.py``, ``race_gathered``, the acceptance kernel) against the
  torch references of the same steps (``fused_ops`` off: the filter and the race are the GPU
  kernels in both), the same choices and q store asserted; and the step's logits to the
  sampling's input, the argmax of a float32 copy against ``argmax_rows`` of the bf16 logits.
Bytes each must move: the filter reads the logits and writes the probabilities (8 bytes a
token), the race reads the probabilities (4); floor = bytes / the copy bandwidth of this run.
Times are medians over ``--reps`` runs with CUDA events, L2 flushed before each; the filter's
also as a CUDA graph replay (without the host's launches, as in the engine's draft graphs).

    python scripts/bench_sampling.py --rows 64,384,576 --out bench_sampling.json \
        [--baseline-filter old_filter.py]   # git show b8e71d5:kernels/sampling.py > old_filter.py
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch
from bench_kernels import Timer, copy_bandwidth, load_module

from aspire_ray.kernels.top_k_top_p import filter_probs
from aspire_ray.plan import Stream
from aspire_ray.worker import sampler
from aspire_ray.worker.rejection_sampler import verify_sampled_batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_sampling.json")
    p.add_argument("--rows", type=ints, default=[64, 384, 576])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--top-p", type=float, default=0.8)
    p.add_argument("--ways", type=ints, default=[4, 8], help="filter search widths")
    p.add_argument("--full-passes", type=ints, default=[2, 3, 4, 6],
                   help="filter passes over whole rows before the candidates are compacted")
    p.add_argument("--accept-rows", type=int, default=64, help="rows of the acceptance case")
    p.add_argument("--gamma", type=int, default=5, help="drafts a row, acceptance case")
    p.add_argument("--verify-every", type=int, default=7,
                   help="choices case: one row in this many verifies")
    p.add_argument("--baseline-filter", default=None,
                   help="a file whose filter_probs(x, T, top_k, top_p, need_k, need_p) is timed "
                        "beside ours (an older kernels file: git show REV:PATH > FILE)")
    p.add_argument("--baseline-race", default=None,
                   help="a file whose race_rows(w, seeds, positions, stream) is timed beside "
                        "ours, the same draws asserted (an older kernels/race.py)")
    p.add_argument("--reps", type=int, default=10)
    return p.parse_args(argv)


def _graphed(fn):
    """fn captured in a CUDA graph: a replay times the GPU's work without the host's launches
    (as in the engine's draft graphs)."""
    fn()  # compiles its kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    baseline = load_module(a.baseline_filter, "baseline_filter") if a.baseline_filter else None
    old_race = load_module(a.baseline_race, "baseline_race") if a.baseline_race else None
    timer = Timer(a.reps)
    copy_gbps = copy_bandwidth(timer)
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: copy bandwidth {copy_gbps:.0f} GB/s")
    results = []
    for n in a.rows:
        gen = torch.Generator().manual_seed(n)
        logits = (3 * torch.randn(n, a.vocab, generator=gen)).cuda()
        temp = torch.full((n,), a.temperature, device="cuda")
        seeds = torch.arange(n, dtype=torch.int64, device="cuda")
        floor_ms = lambda nbytes: nbytes / copy_gbps / 1e6
        for label, k, need_k in (("top-k + top-p", a.top_k, True), ("top-p", 0, False)):
            top_k = torch.full((n,), k, dtype=torch.int64, device="cuda")
            top_p = torch.full((n,), a.top_p, device="cuda")
            args = (logits, temp, top_k, top_p, need_k, True)
            ref = sampler.probs_from_logits_ref(*args)
            row = dict(rows=n, vocab=a.vocab, filter=label,
                       filter_floor_ms=floor_ms(8 * n * a.vocab),
                       filter_ref_ms=timer(partial(sampler.probs_from_logits_ref, *args)),
                       filter_ways={}, filter_max_abs_diff=0.0)  # fmt: skip
            for ways, full in itertools.product(a.ways, a.full_passes):
                run = partial(filter_probs, *args, ways=ways, full_passes=full)
                got = run()
                assert torch.equal(got > 0, ref > 0), (n, label, ways, full)
                row["filter_ways"][f"{ways}x{full}"] = timer(run)
                row["filter_max_abs_diff"] = max(row["filter_max_abs_diff"],
                                                 (got - ref).abs().max().item())  # fmt: skip
            row["filter_ms"] = timer(partial(sampler.probs_from_logits, *args))  # the default
            if baseline is not None:
                old = partial(baseline.filter_probs, *args)
                assert torch.equal(old() > 0, ref > 0), (n, label, "baseline")
                row["filter_baseline_ms"] = timer(old)
            row["filter_graph_ms"] = timer(_graphed(partial(sampler.probs_from_logits, *args)))
            draw = partial(sampler.sample_from_probs, ref, seeds, seeds, Stream.TARGET)
            draw_ref = partial(sampler.race_ref, ref, seeds, seeds, Stream.TARGET)
            same = torch.equal(draw(), draw_ref())
            row.update(race_ms=timer(draw), race_ref_ms=timer(draw_ref), race_same_draws=same,
                       race_floor_ms=floor_ms(4 * n * a.vocab))  # fmt: skip
            # the race on unfiltered rows (every weight above 0), as temperature alone leaves them
            full = torch.softmax(logits / a.temperature, dim=-1)
            row["race_full_support_ms"] = timer(
                partial(sampler.sample_from_probs, full, seeds, seeds, Stream.TARGET))
            if old_race is not None:  # the same draws, filtered rows and full ones
                for key, w in (("race_baseline_ms", ref), ("race_full_support_baseline_ms", full)):
                    before = partial(old_race.race_rows, w, seeds, seeds, int(Stream.TARGET))
                    assert torch.equal(before(), sampler.sample_from_probs(
                        w, seeds, seeds, Stream.TARGET)), (n, label, key)
                    row[key] = timer(before)
            results.append(row)
            ways_ms = " ".join(f"{w}:{ms:.3f}" for w, ms in row["filter_ways"].items())
            if "filter_baseline_ms" in row:
                print(f"rows {n:4d} {label:13s}: baseline filter "
                      f"{row['filter_baseline_ms']:.3f} ms", flush=True)
            if "race_baseline_ms" in row:
                print(f"rows {n:4d} {label:13s}: baseline race {row['race_baseline_ms']:.3f} ms "
                      f"(full support {row['race_full_support_baseline_ms']:.3f})", flush=True)
            print(f"rows {n:4d} {label:13s}: filter {row['filter_ms']:.3f} ms (graph "
                  f"{row['filter_graph_ms']:.3f}; ways {ways_ms}) "
                  f"(torch {row['filter_ref_ms']:.3f}; floor {row['filter_floor_ms']:.3f}), "
                  f"race {row['race_ms']:.3f} ms "
                  f"(torch {row['race_ref_ms']:.3f}; floor {row['race_floor_ms']:.3f}; "
                  f"same draws {same}; full support {row['race_full_support_ms']:.3f})",
                  flush=True)  # fmt: skip
    accept = accept_case(a, timer)
    print(f"accept: {accept['rows']} rows x {accept['gamma']} drafts to host tokens "
          f"{accept['ms']:.3f} ms (mean accepted {accept['mean_accepted']:.2f})", flush=True)
    choices = choices_case(a, timer, "cuda")
    print(f"choices: {choices['rows']} rows, {choices['queries']} queries: "
          f"{choices['ms']:.3f} ms (torch references {choices['torch_ms']:.3f}); logits to "
          f"argmax {choices['argmax_bf16_ms']:.3f} ms (float32 copy + torch "
          f"{choices['argmax_float_ms']:.3f})", flush=True)
    with open(a.out, "w") as f:
        json.dump(dict(device=props.name, torch=torch.__version__, copy_gbps=copy_gbps,
                       args=vars(a), results=results, accept=accept, choices=choices), f,
                  indent=1)  # fmt: skip


def choices_case(a: argparse.Namespace, timer, device: str) -> dict:
    """An asynchronous step's ``sampled_choices`` both ways (module docstring); timer(fn) ->
    ms. Runs on the CPU too (the kernels under Triton's interpreter), where only the checks
    mean anything."""
    from aspire_ray.kernels.argmax import argmax_rows
    from aspire_ray.worker import sampled_rows

    n, gamma, g = a.accept_rows, a.gamma, torch.Generator().manual_seed(1)
    verify = (torch.arange(n) % a.verify_every == 0).long()
    held = torch.where(verify > 0, gamma, torch.arange(n) % gamma)  # draft rows hold < gamma
    qo = torch.cat([torch.zeros(1, dtype=torch.int64),
                    torch.where(verify > 0, gamma + 1, 1).cumsum(0)]).to(torch.int32)
    t = int(qo[-1])
    logits = (3 * torch.randn(t, a.vocab, generator=g)).to(torch.bfloat16)
    q_store = torch.softmax(3 * torch.randn(gamma + 1, n, a.vocab, generator=g), dim=-1)
    chain = torch.randint(0, a.vocab, (gamma + 1, n), generator=g)
    rows = [qo, verify, held, 100 * torch.arange(n), chain, torch.ones(n, dtype=torch.bool),
            torch.arange(n), torch.full((n,), a.top_k), torch.full((n,), a.temperature),
            torch.full((n,), a.top_p)]  # fmt: skip
    on = [x.to(device) for x in [logits, *rows]]
    gpu = device == "cuda"  # the CPU's filter is the torch one, which wants float32
    logits_d = on[0] if gpu else on[0].float()
    argmax = argmax_rows(logits_d) if gpu else logits_d.argmax(dim=-1)
    store = q_store.to(device)
    runs, ms = {}, {}
    for kernels in (True, False):
        step = partial(sampled_rows.sampled_choices, logits_d, argmax, *on[1:],
                       (a.top_k > 0, a.top_p < 1.0), kernels=kernels)  # fmt: skip
        kept = store.clone()
        runs[kernels] = (step(kept), kept)
        ms[kernels] = timer(lambda step=step: step(q_store=store.clone()))
    assert torch.equal(runs[True][0], runs[False][0]), "the choices differ"
    assert torch.equal(runs[True][1], runs[False][1]), "the q stores differ"
    argmax_float = timer(lambda: logits_d.float().argmax(dim=-1))
    argmax_bf16 = timer(partial(argmax_rows, logits_d)) if gpu else argmax_float
    return dict(rows=n, queries=t, verify_every=a.verify_every, gamma=gamma, ms=ms[True],
                torch_ms=ms[False], argmax_bf16_ms=argmax_bf16, argmax_float_ms=argmax_float)


def accept_case(a: argparse.Namespace, timer: Timer) -> dict:
    """A sampled verification's acceptance: ``verify_sampled_batch`` of --accept-rows rows of
    --gamma drafts each down to host tokens, eagerly as the worker runs it (its uploads, the
    race of the residual, the one sync), on bench_flashinfer's inputs."""
    from bench_flashinfer import sampling_inputs

    inputs = argparse.Namespace(sample_batch=a.accept_rows, gamma=a.gamma, vocab=a.vocab,
                                temperature=a.temperature, top_k=a.top_k,
                                top_p=a.top_p)  # fmt: skip
    s = sampling_inputs(inputs, torch.Generator().manual_seed(0), "cuda")
    run = partial(verify_sampled_batch, s.target_probs, s.rows, s.draft_probs)
    accepted = sum(n for n, _ in run()) / a.accept_rows
    return dict(rows=a.accept_rows, gamma=a.gamma, ms=timer(run), mean_accepted=accepted)


if __name__ == "__main__":
    main()
