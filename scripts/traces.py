"""Per-request acceptance traces: recorded from a real greedy run, replayed by simulate.py.

What a trace holds (greedy decoding; one per request and recorded mode):
- ``tokens``: the committed output tokens x_1..x_N (the target's own, greedy);
- ``accept``: one character per output position o, whether a draft proposed there, from the
  exact prefix prompt + x_1..x_{o-1} (every earlier draft of its round accepted), equals x_o:
  ``1`` yes, ``0`` no, ``?`` never observed.

Why this is enough: a round that starts after x_{o-1} and drafts d tokens is accepted up to its
first mismatch, and while its drafts match the target, the draft's prefix *is* the committed
prefix. So a round's accepted count is the run of ``1`` from its first position, capped at d:
one bit per position replaces the draft tokens of every possible round. A real run observes
positions o..o+a of a round that accepted a < d drafts (a ones, then the zero), and o..o+d-1
of a fully accepted one; the position after a fully accepted round, and every position of a
plain (d = 0) verification, stay ``?``. Record with a synchronized mode at a large gamma
(every position is drafted; only full acceptances leave gaps). What the bits leave out: a
draft's sparse KV and its page choice depend a little on where its round started.

Page policies (DESIGN.md §1.6): ``window`` (magicdec: sink + recent pages), ``verify_topk``
(specattn: top-k chosen at verification), ``refresh`` (aspire*: refresh-layer top-k).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from dataclasses import dataclass, field

from aspire_ray.plan import RowKind, rounds_of

FORMAT = "aspire-ray-traces/1"
POLICY_OF_MODE = {"magicdec": "window", "specattn": "verify_topk", "aspire_fixed": "refresh",
                  "aspire_fsm": "refresh", "aspire": "refresh"}  # fmt: skip


def policy_of(mode: str) -> str | None:
    """The page policy of a mode (bench_decode's MODE or MODE/VARIANT); None for ``ar``. The
    variants ``norefresh`` / ``refresh`` (``SpecConfig.draft_refresh``) turn a top-k mode's
    refresh while drafting off or on: "aspire/norefresh" drafts over specattn's pages."""
    spec_mode, _, variant = mode.partition("/")
    policy = POLICY_OF_MODE.get(spec_mode)
    parts = variant.split("+")
    if policy == "refresh" and "norefresh" in parts:
        return "verify_topk"
    if policy == "verify_topk" and "refresh" in parts:
        return "refresh"
    return policy


def accept_bits(num_tokens: int, rounds: list[tuple[int, int, int]]) -> str:
    """rounds: (o, d, a) per verification with d >= 1 drafts (o: output index of its first
    draft, a: drafts accepted) -> the ``accept`` string of ``num_tokens`` positions."""
    bits = ["?"] * num_tokens
    for o, d, a in rounds:
        for j in range(o, min(o + a, num_tokens)):
            bits[j] = "1"
        if a < d and o + a < num_tokens:
            bits[o + a] = "0"
    return "".join(bits)


class TraceRecorder:
    """Watches an engine's steps (it wraps ``engine.executor.execute``; the engine is unchanged)
    and keeps every verification's (o, d, a) per request, until ``detach``."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.rounds: dict[str, list[tuple[int, int, int]]] = {}
        self._execute = engine.executor.execute
        engine.executor.execute = self._observe

    def _observe(self, plan):
        out = self._execute(plan)
        for plan_row, plan_res in zip(plan.rows, out.results, strict=True):
            for row, res in rounds_of(plan_row, plan_res):  # a plan may hold several rounds
                if getattr(row, "verify_after", None) is not None:  # a chain and its verification
                    row, res = row.verify_row(res.tokens), res.verified
                    if res is None:  # an asynchronous run's drafts after its last verification
                        continue
                if row.kind != RowKind.VERIFY or row.num_drafts == 0:
                    continue
                req = self.engine.requests.get(row.req_id)
                if req is None:
                    continue
                # the verify row's input x_n sits at start_pos; its first draft is start_pos + 1
                o = row.start_pos + 1 - len(req.prompt_token_ids)
                self.rounds.setdefault(row.req_id, []).append((o, row.num_drafts,
                                                               res.num_accepted))
        return out

    def detach(self) -> None:
        self.engine.executor.execute = self._execute

    def trace(self, req_id: str, tokens: list[int]) -> str:
        return accept_bits(len(tokens), self.rounds.get(req_id, []))


@dataclass
class RequestTrace:
    prompt_len: int
    tokens: dict[str, list[int]] = field(default_factory=dict)  # recorded mode -> outputs
    accept: dict[str, str] = field(default_factory=dict)  # recorded mode -> bits
    domain: str | None = None


def open_json(path: str, mode: str = "r"):
    """A JSON file's text stream, gzip-compressed where the name ends in ``.gz`` (the trace
    files in docs/ are: ~10x smaller, and a GPU call carries the work tree in 64 MiB)."""
    return gzip.open(path, mode + "t") if path.endswith(".gz") else open(path, mode)


def read_json(path: str):
    with open_json(path) as f:
        return json.load(f)


@dataclass
class Traces:
    """Recorded runs of one batch of requests. ``meta``: what the engine ran (num_layers,
    page_size, the SpecConfig's page-budget fields, model, context, batch, device);
    ``modes``: recorded mode -> {gamma, tokens_per_s, mean_accepted_length, ...}."""

    meta: dict
    modes: dict[str, dict]
    requests: list[RequestTrace]

    def add_run(self, mode: str, summary: dict, outs, recorder: TraceRecorder) -> None:
        """One recorded mode: ``outs`` are its RequestOutputs in request order."""
        self.modes[mode] = summary
        if not self.requests:
            self.requests = [RequestTrace(len(o.prompt_token_ids)) for o in outs]
        for rt, o in zip(self.requests, outs, strict=True):
            rt.tokens[mode] = list(o.token_ids)
            if policy_of(mode):
                rt.accept[mode] = recorder.trace(o.request_id, o.token_ids)

    def source_modes(self, policy: str) -> list[str]:
        """Recorded modes of a page policy, the best source first (most observed positions)."""
        modes = [m for m in self.modes if policy_of(m) == policy
                 and all(m in r.accept for r in self.requests)]  # fmt: skip
        return sorted(modes, key=lambda m: sum(r.accept[m].count("?") for r in self.requests))

    def replay(self, mode: str) -> tuple[list[list[int]], list[str], dict]:
        """Tokens and fully known bits for simulating ``mode``: its own recording where there
        is one (its rounds then replay exactly), else the best recording of its page policy;
        ``?`` filled from the policy's other recordings, then by the nearest known bit before
        it (after a fully accepted round: accepted; in a stretch of plain verifications:
        rejected; nothing before it: accepted). ``ar`` takes the first recording's tokens."""
        if mode == "ar":
            first = next(iter(self.modes))
            return [r.tokens[first] for r in self.requests], [], {"source": first}
        policy = policy_of(mode)
        sources = self.source_modes(policy)
        if not sources:
            raise SystemExit(f"no recorded trace of page policy {policy!r} (for {mode}); "
                             f"recorded: {sorted(self.modes)}")
        if mode in sources:
            sources.remove(mode)
            sources.insert(0, mode)
        tokens, bits, unknown, total = [], [], 0, 0
        for r in self.requests:
            main = r.tokens[sources[0]]
            b = list(r.accept[sources[0]])
            for other in sources[1:]:  # the same continuation only up to any divergence
                same = _common_prefix(main, r.tokens[other])
                for j in range(same):
                    if b[j] == "?":
                        b[j] = r.accept[other][j]
            unknown += b[1:].count("?")  # position 0 comes from the prompt, never drafted
            total += max(len(b) - 1, 0)
            last = "1"
            for j, c in enumerate(b):
                if c == "?":
                    b[j] = last
                else:
                    last = c
            tokens.append(main)
            bits.append("".join(b))
        info = {"source": sources[0], "filled_from": sources[1:],
                "unknown_frac": unknown / total if total else 0.0}
        return tokens, bits, info

    def to_json(self) -> dict:
        return {"format": FORMAT, "meta": self.meta, "modes": self.modes,
                "requests": [{"prompt_len": r.prompt_len, "domain": r.domain, "tokens": r.tokens,
                              "accept": r.accept} for r in self.requests]}  # fmt: skip

    def save(self, path: str) -> None:
        with open_json(path, "w") as f:
            json.dump(self.to_json(), f, separators=(",", ":"))

    @classmethod
    def load(cls, path: str) -> Traces:
        data = read_json(path)
        if data.get("format") != FORMAT:
            raise SystemExit(f"{path}: not a trace file of format {FORMAT}")
        reqs = [RequestTrace(r["prompt_len"], r["tokens"], r["accept"], r.get("domain"))
                for r in data["requests"]]  # fmt: skip
        return cls(data["meta"], data["modes"], reqs)


def engine_meta(engine) -> dict:
    """What the simulator needs of the recording engine to rebuild its features."""
    spec = engine.cfg.spec
    return {"num_layers": engine.info.num_layers, "page_size": engine.cfg.cache.page_size,
            "vocab_size": engine.info.vocab_size, "model": engine.cfg.model,
            "device": engine.info.device_name,
            "query_tile_tokens": engine.info.query_tile_tokens,
            "spec": {"k_min": spec.k_min, "rho": spec.rho, "recent_pages": spec.recent_pages,
                     "keep_sink_page": spec.keep_sink_page, "d_max": spec.d_max}}  # fmt: skip


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def synthetic(alphas: list[float], prompt_len: int, num_tokens: int, meta: dict,
              seed: int = 0) -> Traces:
    """Traces of i.i.d. acceptance: request i's draft at each output position is accepted with
    probability alphas[i], the same bits for every page policy (a workload of known acceptance,
    to check the policy's estimates and choices, not to predict a text's). ``meta`` as
    ``engine_meta`` gives it (the deployment's depth, page size, query tile, page budget)."""
    rng = random.Random(seed)
    traces = Traces(dict(meta, context=prompt_len, synthetic=True), {}, [])
    for alpha in alphas:
        bits = "".join("1" if rng.random() < alpha else "0" for _ in range(num_tokens))
        tokens = [rng.randrange(1, 1 << 16) * 2 for _ in range(num_tokens)]  # even: t + 1 differs
        rt = RequestTrace(prompt_len, domain=f"alpha={alpha:g}")
        for mode in ("magicdec", "specattn", "aspire_fixed"):  # one per page policy
            rt.tokens[mode], rt.accept[mode] = tokens, bits
        traces.requests.append(rt)
    traces.modes = {m: {"gamma": None, "synthetic": True}
                    for m in ("magicdec", "specattn", "aspire_fixed")}  # fmt: skip
    return traces


def qwen_meta(num_layers: int = 24, page_size: int = 16, query_tile_tokens: int = 9) -> dict:
    """``engine_meta`` of the real Qwen2.5-Coder-0.5B deployment (24 layers, 7-head GQA groups:
    9 query tokens a 64-row tile) with the default page budget."""
    from aspire_ray.config import SpecConfig

    spec = SpecConfig()
    return {"num_layers": num_layers, "page_size": page_size, "vocab_size": 151936,
            "model": "synthetic", "device": "synthetic", "query_tile_tokens": query_tile_tokens,
            "spec": {"k_min": spec.k_min, "rho": spec.rho, "recent_pages": spec.recent_pages,
                     "keep_sink_page": spec.keep_sink_page, "d_max": spec.d_max}}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description="Write synthetic acceptance traces (i.i.d. bits).")
    p.add_argument("--alphas", required=True,
                   help="comma list of acceptance rates, assigned to the requests in turn")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=96, help="output tokens per request")
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    levels = [float(a) for a in args.alphas.split(",")]
    alphas = [levels[i % len(levels)] for i in range(args.batch)]
    synthetic(alphas, args.prompt_len, args.tokens, qwen_meta(args.num_layers),
              args.seed).save(args.out)


if __name__ == "__main__":
    main()
