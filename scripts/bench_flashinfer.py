"""Our attention and sampling kernels against flashinfer's, fairly: same inputs, one process.

Attention (bf16, Qwen2.5-Coder-0.5B heads by default: 14 q / 2 kv heads of 64, pages of 16;
KV cache [pages, 2, page_size, kv_heads, head_dim], flashinfer's single-tensor "NHD" layout):
- decode: rows of 1 query over full page lists;
- verify: rows of ``--verify-q`` queries (gamma + 1) over full page lists;
- mixed: verify rows (a ``--mixed-verify`` share of the batch) beside 1-query draft rows over
  sparse page lists (a random ``--sparse-frac`` of each row's pages, last page last), as in a
  mixed ASPIRE step.
Ours (``paged_attention``) against every flashinfer wrapper that can run the rows:
``BatchDecodeWithPagedKVCacheWrapper`` (CUDA cores / tensor cores, split-KV on / off; tensor
cores with ``q_len_per_req`` for verify rows), ``BatchAttention``, and
``BatchPrefillWithPagedKVCacheWrapper`` (backend auto, as our flashinfer backend, and fa2).
A wrapper that rejects the shape is listed with its error (flashinfer's CUDA-core decode has no
GQA group 7 kernel). Plans are made once, outside the timing, as an engine does once per step.

Sampling (vocab 151,936, batch 64, gamma 5, temperature / top-k / top-p per row), ours
(``worker/sampler.py``, ``worker/rejection_sampler.py``: on a GPU the Triton kernels of
``kernels/race.py`` and ``top_k_top_p.py``; their torch references beside them for draw and
filter) against ``flashinfer.sampling``:
- draw: filter + sample from logits (ours: ``probs_from_logits`` + ``sample_from_probs``;
  flashinfer: ``softmax`` + ``top_k_top_p_sampling_from_probs``, or
  ``top_k_top_p_sampling_from_logits``); check: share of draws inside our filtered support;
- filter: the filtered distribution q a draft needs for its acceptance test (flashinfer:
  ``softmax`` + ``top_k_renorm_probs`` + ``top_p_renorm_probs``); check: max abs diff;
- accept: speculative rejection sampling of gamma drafts per row down to host tokens (ours:
  ``verify_sampled_batch``, one sync; flashinfer: ``chain_speculative_sampling`` + ``tolist``);
  check: mean accepted drafts per row (equal in expectation).

Every time is the median over ``--reps`` runs with CUDA events, L2 flushed before each run
(``bench_kernels.Timer``; the 1 GiB flush also hides the host's launch time). GB/s counts the
bytes a kernel must read and write once (attention: K and V of every listed token, q, out;
sampling: its float32 inputs), against the copy bandwidth measured in the same run.
"ours / it" is its time over ours (> 1: ours is faster).

    FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 python scripts/bench_flashinfer.py \
        --out bench_flashinfer.json

flashinfer JIT-builds each kernel at its first use (minutes each without flashinfer-jit-cache);
``--parts`` runs a subset, e.g. one part per call while the JIT cache (~/.cache/flashinfer) stays.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
from bench_kernels import Timer, copy_bandwidth

from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.plan import Stream
from aspire_ray.worker import sampler
from aspire_ray.worker.rejection_sampler import SampledVerify, verify_sampled_batch
from aspire_ray.worker.sampler import probs_from_logits, sample_from_probs

PARTS = ("decode", "verify", "mixed", "sampling")
WORKSPACE_BYTES = 128 << 20  # flashinfer's recommended float workspace per wrapper


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",")]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_flashinfer.json", help="where to write the JSON")
    p.add_argument("--parts", default=",".join(PARTS), help=f"a subset of {','.join(PARTS)}")
    p.add_argument("--batches", type=ints, default=[16, 64])
    p.add_argument("--contexts", type=ints, default=[16384, 32768])
    p.add_argument("--q-heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--verify-q", type=int, default=6, help="queries per verify row (gamma + 1)")
    p.add_argument("--mixed-verify", type=float, default=0.25, help="verify rows' share, mixed")
    p.add_argument("--sparse-frac", type=float, default=0.07, help="draft rows' share of pages")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--sample-batch", type=int, default=64)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--top-p", type=float, default=0.8)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args(argv)
    unknown = set(a.parts.split(",")) - set(PARTS)
    if unknown:
        p.error(f"unknown --parts {sorted(unknown)}; choose from {PARTS}")
    return a


# ---- inputs and byte counts (CPU) ----


class Rows(NamedTuple):
    """One attention call's rows, as ``PagedKVMeta.build`` takes them."""

    q_lens: list[int]
    page_lists: list[list[int]]  # physical page ids, in order
    kv_lens: list[int]  # tokens in the listed pages (the last page may be partial)
    num_pages: int  # pages of the pool the rows draw from (ids 0..num_pages-1)


def step_rows(specs: list[tuple[int, int, float]], page_size: int, gen: torch.Generator) -> Rows:
    """Rows of (queries, context tokens, share of its pages listed), each on its own random
    physical pages. A sparse row (share < 1) lists a random ascending subset of its pages with
    its last page last, as a draft row's page selection, and attends those tokens only."""
    sizes = [-(-ctx // page_size) for _, ctx, _ in specs]
    perm = torch.randperm(sum(sizes), generator=gen).tolist()
    q_lens, lists, kv_lens, start = [], [], [], 0
    for (n_q, ctx, frac), n in zip(specs, sizes, strict=True):
        own, start = perm[start : start + n], start + n
        last_len = ctx - (n - 1) * page_size
        if frac < 1.0:
            k = max(1, math.ceil(frac * n))
            keep = sorted(torch.randperm(n - 1, generator=gen)[: k - 1].tolist()) + [n - 1]
            own = [own[i] for i in keep]
        q_lens.append(n_q)
        lists.append(own)
        kv_lens.append((len(own) - 1) * page_size + last_len)
    return Rows(q_lens, lists, kv_lens, sum(sizes))


def part_rows(
    part: str, batch: int, context: int, a: argparse.Namespace, gen: torch.Generator
) -> Rows:
    """The rows of one case of an attention part."""
    if part == "decode":
        specs = [(1, context, 1.0)] * batch
    elif part == "verify":
        specs = [(a.verify_q, context, 1.0)] * batch
    else:  # mixed: verify rows, then draft rows over sparse lists
        n_verify = max(1, round(a.mixed_verify * batch))
        specs = [(a.verify_q, context, 1.0)] * n_verify
        specs += [(1, context, a.sparse_frac)] * (batch - n_verify)
    return step_rows(specs, a.page_size, gen)


def attention_bytes(rows: Rows, q_heads: int, kv_heads: int, head_dim: int, elem: int) -> int:
    """Bytes an attention call must move: K and V of every listed token once, q in, out out."""
    kv = sum(rows.kv_lens) * 2 * kv_heads * head_dim
    return (kv + 2 * sum(rows.q_lens) * q_heads * head_dim) * elem


def tensor_bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def flashinfer_host_args(meta: PagedKVMeta) -> dict[str, torch.Tensor]:
    """The step's indptrs and lengths as host int32 tensors: flashinfer's ``plan`` reads them
    on the host (device ones would be copied back, a sync). kv_lens: tokens per row
    (``BatchAttention``'s kv_len_arr); last_page_len: the wrappers' paged_kv_last_page_len."""
    host = lambda xs: torch.tensor(xs, dtype=torch.int32)
    kv_lens = [meta.kv_len_host(r) for r in range(len(meta.kv_last_page_len_host))]
    return {
        "qo_indptr": host(meta.qo_indptr_host),
        "kv_indptr": host(meta.kv_indptr_host),
        "last_page_len": host(meta.kv_last_page_len_host),
        "kv_lens": host(kv_lens),
    }


class SamplingInputs(NamedTuple):
    """One sampling step: B rows, gamma drafts each, vocabulary V."""

    logits: torch.Tensor  # float32 [B, V]: the draw's and the filter's input (p_0's logits)
    temperature: torch.Tensor  # float32 [B]
    top_k: torch.Tensor  # int64 [B]
    top_p: torch.Tensor  # float32 [B]
    target_probs: torch.Tensor  # float32 [B * (gamma + 1), V]: p_0..p_gamma per row
    draft_probs: torch.Tensor  # float32 [B * gamma, V]: the q each draft was drawn from
    drafts: torch.Tensor  # int64 [B, gamma]
    rows: list[SampledVerify]  # the verify rows of ``verify_sampled_batch``


def sampling_inputs(a: argparse.Namespace, gen: torch.Generator, device: str) -> SamplingInputs:
    """Random logits (--sample-batch rows, --gamma drafts, --vocab); the draft's logits are the
    target's plus noise (a draft that agrees often, not always); drafts drawn from the draft's
    filtered distributions (--temperature, --top-k, --top-p, the same for every row)."""
    b, g, v = a.sample_batch, a.gamma, a.vocab
    full = lambda n, x, dt: torch.full((n,), x, dtype=dt, device=device)
    params = lambda n: (full(n, a.temperature, torch.float32), full(n, a.top_k, torch.int64),
                        full(n, a.top_p, torch.float32))  # fmt: skip
    need = (a.top_k > 0, a.top_p < 1.0)
    target_logits = 3 * torch.randn(b * (g + 1), v, generator=gen).to(device)
    noise = torch.randn(b, g, v, generator=gen).to(device)
    draft_logits = (target_logits.view(b, g + 1, v)[:, :g] + noise).reshape(b * g, v)
    draft_probs = probs_from_logits(draft_logits, *params(b * g), *need)
    seeds = torch.arange(b * g, dtype=torch.int64, device=device)
    drafts = sample_from_probs(draft_probs, seeds, seeds, Stream.DRAFT).view(b, g)
    rows = [SampledVerify(i * (g + 1), d, seed=i, pos0=0) for i, d in enumerate(drafts.tolist())]
    return SamplingInputs(target_logits[:: g + 1].contiguous(), *params(b),
                          probs_from_logits(target_logits, *params(b * (g + 1)), *need),
                          draft_probs, drafts, rows)  # fmt: skip


# ---- results (CPU) ----


@dataclass
class Case:
    """One case's measurements: ours first, then each flashinfer kernel, on the same inputs.

    A check maps a kernel's output to (what, value): the max abs diff from ours, or a
    statistic where the outputs are random draws."""

    part: str
    name: str
    nbytes: int  # bytes the kernels must move (GB/s = nbytes / time)
    copy_gbps: float
    timer: Callable[[Callable], float] | None = None
    entries: list[dict] = field(default_factory=list)

    def entry(self, kernel: str, ms: float, check: tuple[str, float]) -> dict:
        ours_ms = self.entries[0]["ms"] if self.entries else ms
        gbps = self.nbytes / ms / 1e6
        e = dict(part=self.part, case=self.name, kernel=kernel, ms=ms, gbps=gbps,
                 pct_copy=gbps / self.copy_gbps, ours_over_it=ms / ours_ms,
                 check=check[0], check_value=check[1])  # fmt: skip
        self.entries.append(e)
        return e

    def add(self, kernel: str, fn: Callable, check: Callable) -> None:
        """Time fn and check its output, or record why it could not run."""
        try:
            first = fn()  # plans and JIT builds happen before the timing
            ms = self.timer(fn)
        except Exception as e:  # noqa: BLE001 - a kernel that rejects the shape is a result
            if not self.entries:  # ours comes first and must run
                raise
            error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"
            self.entries.append(dict(part=self.part, case=self.name, kernel=kernel, error=error))
            return
        self.entry(kernel, ms, check(first))


def summary(entries: list[dict]) -> list[dict]:
    """Per case: ours against the fastest flashinfer kernel that ran."""
    out = []
    for part, case in dict.fromkeys((e["part"], e["case"]) for e in entries):
        ran = [e for e in entries if (e["part"], e["case"]) == (part, case) and "ms" in e]
        ours, theirs = ran[0], [e for e in ran if e["kernel"].startswith("fi ")]
        if ours["kernel"] == "ours" and theirs:
            best = min(theirs, key=lambda e: e["ms"])
            ratio = best["ms"] / ours["ms"]
            out.append(dict(part=part, case=case, ours_ms=ours["ms"], best=best["kernel"],
                            best_ms=best["ms"], ours_over_best=ratio))  # fmt: skip
    return out


def markdown(result: dict) -> str:
    """The results as markdown: every kernel, then ours against the fastest flashinfer one."""
    lines = [f"{result['device']}, flashinfer {result['flashinfer']}, copy bandwidth "
             f"{result['copy_gbps']:.0f} GB/s", "",
             "| part | case | kernel | ms | GB/s | % of copy | ours / it | check |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for e in result["entries"]:
        cells = (f"{e['ms']:.3f} | {e['gbps']:.0f} | {e['pct_copy']:.0%} | "
                 f"{e['ours_over_it']:.2f}x | {e['check']} {e['check_value']:.3g}"
                 if "ms" in e else f"error: {e['error']} | | | |")  # fmt: skip
        lines.append(f"| {e['part']} | {e['case']} | {e['kernel']} | {cells} |")
    lines += ["", "| part | case | fastest flashinfer | ours / it |", "|---|---|---|---|"]
    for s in result["summary"]:
        lines.append(f"| {s['part']} | {s['case']} | {s['best']} | {s['ours_over_best']:.2f}x |")
    return "\n".join(lines)


def write_json(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


# ---- the GPU runs ----


def flashinfer_attention(q, kv_cache, meta: PagedKVMeta, scale: float) -> dict[str, Callable]:
    """name -> a run of one flashinfer wrapper planned for these rows (planned at its first
    call, once; later calls only run). q [T, Hq, D], kv_cache [P, 2, ps, Hkv, D]."""
    import flashinfer

    heads = (q.shape[1], kv_cache.shape[3], q.shape[2])  # Hq, Hkv, D
    h = flashinfer_host_args(meta)
    dt = dict(q_data_type=q.dtype, kv_data_type=kv_cache.dtype, sm_scale=scale)
    q_lens = {b - a for a, b in zip(meta.qo_indptr_host[:-1], meta.qo_indptr_host[1:], strict=True)}
    workspace = lambda: torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)

    def decode(tensor_cores: bool, split: bool):
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace(), "NHD", use_tensor_cores=tensor_cores
        )
        (n_q,) = q_lens
        extra = {"q_len_per_req": n_q} if n_q > 1 else {}
        if not split:
            extra["disable_split_kv"] = True
        w.plan(h["kv_indptr"], meta.kv_indices, h["last_page_len"], *heads, meta.page_size,
               **dt, **extra)  # fmt: skip
        return partial(w.run, q, kv_cache)

    def batch_attention():
        w = flashinfer.BatchAttention(kv_layout="NHD", device=str(q.device))
        dev = {k: t.to(q.device) for k, t in h.items()}
        w.plan(dev["qo_indptr"], dev["kv_indptr"], meta.kv_indices, dev["kv_lens"], *heads,
               heads[2], meta.page_size, causal=True, **dt)  # fmt: skip
        return lambda: w.run(q, kv_cache)[0]

    def prefill(backend: str):
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD", backend=backend)
        w.plan(h["qo_indptr"], h["kv_indptr"], meta.kv_indices, h["last_page_len"], *heads,
               meta.page_size, causal=True, **dt)  # fmt: skip
        return partial(w.run, q, kv_cache)

    makers = {}
    if len(q_lens) == 1:  # the decode wrapper takes rows of one query length only
        if q_lens == {1}:  # CUDA cores: one query per row
            makers["fi decode"] = partial(decode, False, True)
            makers["fi decode no-split"] = partial(decode, False, False)
        makers["fi decode tc"] = partial(decode, True, True)
        makers["fi decode tc no-split"] = partial(decode, True, False)
    if hasattr(flashinfer, "BatchAttention"):
        makers["fi BatchAttention"] = batch_attention
    makers["fi prefill auto"] = partial(prefill, "auto")
    makers["fi prefill fa2"] = partial(prefill, "fa2")
    return {name: _planned_once(make) for name, make in makers.items()}


def _planned_once(make: Callable[[], Callable]) -> Callable:
    run = None

    def call():
        nonlocal run
        run = run or make()
        return run()

    return call


def bench_attention(part: str, batch: int, context: int, a, timer, copy_gbps: float) -> Case:
    from aspire_ray.kernels.paged_attention import paged_attention

    gen = torch.Generator().manual_seed(batch * context)
    rows = part_rows(part, batch, context, a, gen)
    kv_cache = torch.randn(rows.num_pages, 2, a.page_size, a.kv_heads, a.head_dim,
                           dtype=torch.bfloat16, device="cuda")  # fmt: skip
    meta = PagedKVMeta.build(rows.q_lens, rows.page_lists, rows.kv_lens, a.page_size, "cuda")
    q = torch.randn(sum(rows.q_lens), a.q_heads, a.head_dim, dtype=torch.bfloat16, device="cuda")
    scale = a.head_dim**-0.5
    nbytes = attention_bytes(rows, a.q_heads, a.kv_heads, a.head_dim, 2)
    case = Case(part, f"B{batch} ctx{context // 1024}k", nbytes, copy_gbps, timer)
    ours = partial(paged_attention, q, kv_cache, meta, scale)
    ref = ours().float()
    diff = lambda out: ("max abs diff", (out.float() - ref).abs().max().item())
    case.add("ours", ours, diff)
    for name, run in flashinfer_attention(q, kv_cache, meta, scale).items():
        case.add(name, run, diff)
    return case


def bench_sampling(a, timer, copy_gbps: float) -> list[Case]:
    import flashinfer.sampling as fs

    s = sampling_inputs(a, torch.Generator().manual_seed(0), "cuda")
    b, g, v = a.sample_batch, a.gamma, a.vocab
    name = f"B{b} V{v} gamma{g}"
    seeds = torch.arange(b, dtype=torch.int64, device="cuda")
    filt = partial(probs_from_logits, s.logits, s.temperature, s.top_k, s.top_p, True, True)
    filt_ref = partial(sampler.probs_from_logits_ref, s.logits, s.temperature, s.top_k, s.top_p,
                       True, True)  # fmt: skip
    ref = filt()
    in_support = lambda t: ("in support", (ref[seeds, t.long()] > 0).float().mean().item())
    diff = lambda p: ("max abs diff", (p - ref).abs().max().item())

    # draw: filter + sample from logits, per-row temperature / top-k / top-p
    draw = Case("sampling draw", name, tensor_bytes(s.logits), copy_gbps, timer)
    draw.add("ours", lambda: sample_from_probs(filt(), seeds, seeds, Stream.TARGET), in_support)
    draw.add("ours, torch reference",
             lambda: sampler.race_ref(filt_ref(), seeds, seeds, Stream.TARGET), in_support)
    softmax = lambda: fs.softmax(s.logits, s.temperature)
    k32 = s.top_k.to(torch.int32)  # flashinfer's index type: no conversion inside the timing
    draw.add(
        "fi softmax + top_k_top_p_sampling_from_probs",
        lambda: fs.top_k_top_p_sampling_from_probs(softmax(), k32, s.top_p),
        in_support,
    )
    draw.add("fi top_k_top_p_sampling_from_logits", lambda: fs.top_k_top_p_sampling_from_logits(
        s.logits / s.temperature[:, None], k32, s.top_p), in_support)  # fmt: skip
    # filter: the distribution q a draft is drawn from, which its acceptance test needs
    filt_case = Case("sampling filter", name, tensor_bytes(s.logits), copy_gbps, timer)
    filt_case.add("ours", filt, diff)
    filt_case.add("ours, torch reference", filt_ref, diff)
    filt_case.add("fi softmax + top_k_renorm + top_p_renorm", lambda: fs.top_p_renorm_probs(
        fs.top_k_renorm_probs(softmax(), k32), s.top_p), diff)  # fmt: skip
    # accept: speculative rejection sampling of every row's drafts, down to host tokens
    nb = tensor_bytes(s.target_probs, s.draft_probs)
    accept = Case("sampling accept", name, nb, copy_gbps, timer)
    accept.add("ours", partial(verify_sampled_batch, s.target_probs, s.rows, s.draft_probs),
               lambda res: ("mean accepted", sum(n for n, _ in res) / b))  # fmt: skip
    ids = s.drafts.to(torch.int32)
    chain = lambda: fs.chain_speculative_sampling(
        s.draft_probs.view(b, g, v), ids, s.target_probs.view(b, g + 1, v)
    )
    # tokens, accepted, emitted to the host, as ours returns them; emitted = accepted drafts
    accept.add("fi chain_speculative_sampling", lambda: [t.tolist() for t in chain()],
               lambda res: ("mean accepted", sum(res[2]) / b))  # fmt: skip
    return [draw, filt_case, accept]


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_flashinfer needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        import flashinfer
    except ImportError as e:
        sys.exit(f"bench_flashinfer needs flashinfer-python ({e}): install it (pip, or "
                 "scripts/offline_bundle.py --flashinfer-only on a host without network: "
                 "scripts/gpu_runs.sh prepare-fi / flashinfer) and run with "
                 "FLASHINFER_CUDA_ARCH_LIST=9.0a")  # fmt: skip
    timer = Timer(a.reps)
    props = torch.cuda.get_device_properties(0)
    copy_gbps = copy_bandwidth(timer)
    print(f"{props.name}: copy bandwidth {copy_gbps:.0f} GB/s, flashinfer {flashinfer.__version__}")
    parts, cases = a.parts.split(","), []
    for part in (p for p in PARTS[:3] if p in parts):
        for context in a.contexts:
            for batch in a.batches:
                cases.append(bench_attention(part, batch, context, a, timer, copy_gbps))
                torch.cuda.empty_cache()
                for e in cases[-1].entries:
                    got = f"{e['gbps']:.0f} GB/s" if "ms" in e else e["error"]
                    print(f"{part} {e['case']} {e['kernel']}: {got}", flush=True)
    if "sampling" in parts:
        cases += bench_sampling(a, timer, copy_gbps)
    entries = [e for c in cases for e in c.entries]
    result = dict(device=props.name, torch=torch.__version__, flashinfer=flashinfer.__version__,
                  copy_gbps=copy_gbps, args=vars(a), entries=entries,
                  summary=summary(entries))  # fmt: skip
    write_json(a.out, result)
    print(markdown(result))


if __name__ == "__main__":
    main()
