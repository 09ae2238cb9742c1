"""Continuous batching without phases (vLLM v1 style) plus per-request speculation.

Each step every running request gets at most one row: a prefill chunk (catching
``num_computed`` up to its committed tokens), or, once decoding, the action its draft policy
picks (draft / verify / idle). Waiting requests are admitted FCFS while the token budget,
``max_num_seqs`` and free pages allow, keeping free what every running request (and the new
one) lacks for its whole prompt and one more plan (``headroom_tokens``). When pages still run
out, a request not yet scheduled this step is preempted, the one with the least KV to
recompute (a long prompt is the last resort): its pages are freed and it is recomputed later.

After the step, ``update`` owns every change of a request's state: drafts held, tokens
committed (stop conditions on committed tokens only), the policy's acceptance estimate, the KV
length and the pages past it; the engine only turns what changed into outputs.
"""

from __future__ import annotations

import time
from collections import deque

from aspire_ray.config import SchedulerConfig
from aspire_ray.plan import (
    RowKind,
    RowPlan,
    RowResult,
    StepOutput,
    StepPlan,
    async_kinds,
    held_after,
    rounds_of,
)
from aspire_ray.spec.draft_policy import Action, DraftPolicy

from .block_manager import BlockManager
from .detokenizer import Detokenizer
from .request import Request, Status


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, max_model_len: int, blocks: BlockManager,
                 policy: DraftPolicy, detok: Detokenizer | None = None,
                 eos_token_ids: set[int] | frozenset[int] = frozenset()) -> None:  # fmt: skip
        """detok: text for stop strings and finished requests (None: token ids only);
        eos_token_ids: stop tokens of the model (unless a request ignores EOS)."""
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.blocks = blocks
        self.policy = policy
        self.detok = detok or Detokenizer(None)
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._dropped: list[str] = []
        self._step_id = 0
        self.num_preemptions = 0
        self._unscheduled: list[Request] = []  # see schedule()
        # draft lengths the last asynchronous run promised for the run after it (its rows'
        # next_async_gamma): the worker may have started that run with them
        self._promised: dict[str, int] = {}
        # decode steps run so far (a plan's steps: a run's or chain's length, else 1): the
        # verify slots' clock (SpecConfig.verify_quantum)
        self.decode_steps = 0
        self.headroom_tokens = (cfg.admission_headroom_tokens
                                if cfg.admission_headroom_tokens is not None
                                else policy.cfg.plan_growth_tokens)  # fmt: skip
        # While True, only prompts are computed: requests that finished their prefill wait.
        # Decode benchmarks set it so that every request of a batch starts decoding together
        # (otherwise early requests decode, or even finish, while later prompts prefill).
        self.pause_decoding = False

    # ---- membership --------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.policy.on_admit(req)
        self.waiting.append(req)

    def finish(self, req: Request, reason: str) -> None:
        """Remove a request for good (stop, length, abort, error) and free its pages."""
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
        req.finish_reason = reason

    def end(self, req: Request, reason: str, decode: bool = True) -> None:
        """``finish`` with the request's final text (decode: from all its tokens) and time."""
        if decode:
            req.text = self.detok.decode(req.output_token_ids)
        req.metrics.finish_time = time.time()
        self.finish(req, reason)

    def _release(self, req: Request) -> None:
        self.blocks.free(req.req_id, req.pages)
        req.pages, req.synced_pages = [], 0
        if req.worker_known:
            self._dropped.append(req.req_id)
            req.worker_known = False

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed = 0
        req.drafts = []
        req.status = Status.WAITING
        req.metrics.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def truncate_pages(self, req: Request, lookahead: int = 0) -> None:
        """Return pages past the exact KV (after a verification rejected drafts) and
        ``lookahead`` tokens more (the pages an asynchronous run's successor may be using)."""
        keep = self.blocks.pages_for(req.num_computed + len(req.drafts) + lookahead)
        if keep < len(req.pages):
            self.blocks.free(req.req_id, req.pages[keep:])
            del req.pages[keep:]
            req.synced_pages = min(req.synced_pages, keep)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ----------------------------------------------------------------------------
    def draft_cap(self, req: Request) -> int:
        """Most drafts the request may hold: a verification commits up to d + 1 tokens, within
        the context. In the synchronized modes a request near its max_tokens drafts the
        round's length all the same (the commit drops what passes the limit, ``_append``),
        so that its last round stays the batch's round: capped, it split every row's round
        into chains off the round graphs (docs/benchmarks.md §8.60)."""
        spec = self.policy.cfg
        left = spec.d_max if spec.synchronized else req.remaining_tokens - 1
        return max(0, min(spec.d_max, left, self.max_model_len - req.num_tokens))

    def schedule(self) -> StepPlan:
        budget = self.cfg.max_num_batched_tokens
        rows: list[RowPlan] = []
        new_requests = {}
        decoding = [] if self.pause_decoding else [r for r in self.running if not r.in_prefill]
        caps = [self.draft_cap(r) for r in decoding]
        alone = bool(decoding) and len(decoding) == len(self.running) and not self.waiting
        promised, self._promised = self._promised, {}
        gammas = self._async_gammas(decoding, caps, budget, promised) if alone else None
        decided = [Action.DRAFT] * len(decoding) if gammas else \
            self.policy.decide(decoding, caps, self.decode_steps)  # fmt: skip
        actions = dict(zip((r.req_id for r in decoding), decided, strict=True))
        # a draft chain only when nothing else would run (no prefill, nobody waiting: a chain
        # must not delay admissions); the worker draws its drafts on the device, and verifies
        # its round in the same plan (sampled rows too: worker/sampled_rows.py).
        chain, verify_after = 1, False
        if gammas:  # an asynchronous run: every request, its own draft length
            chain = self._async_length(decoding)
            next_chain = self._async_length(decoding, self.decode_steps + chain)
        elif alone:
            if not self.policy.cfg.speculative:
                chain = self._decode_chain(decoding)
            else:
                chain, verify_after = self.policy.chain_length(decoding, caps, decided)
            # the round's verify rows must fit the step's token budget
            verify_after &= sum(r.num_tokens - r.num_computed + len(r.drafts) + chain
                                for r in decoding) <= budget  # fmt: skip
        rounds = self._rounds(decoding, chain) if verify_after else 1
        if decoding:
            self.decode_steps += chain
        # running requests with no row in this step yet, in order (the preemption victims)
        self._unscheduled = list(self.running)
        while self._unscheduled:
            req = self._unscheduled.pop(0)
            if self.pause_decoding and not req.in_prefill:
                continue
            if gammas:
                row = self._async_row(req, gammas[req.req_id], (chain, next_chain),
                                      self._promised[req.req_id])  # fmt: skip
            else:
                row = self._row_for(req, actions.get(req.req_id), budget, chain, verify_after,
                                    rounds)  # fmt: skip
            if row is None:
                continue
            if not self._ensure_pages(req, row.final_context_len):
                continue  # req itself was preempted
            rows.append(self._attach_pages(req, row))
            budget -= row.num_tokens
        # no admissions beside a chain (a request it preempted waits for the next step)
        reserve = None  # pages the running requests lack for one more plan (headroom)
        while chain == 1 and not verify_after and self.waiting and budget > 0 \
                and len(self.running) < self.cfg.max_num_seqs:  # fmt: skip
            req = self.waiting[0]
            row = self._row_for(req, None, budget)
            need = self.blocks.pages_for(row.context_len) - len(req.pages)
            if self.headroom_tokens and self.running:
                if reserve is None:  # once per step: O(running), not per admission
                    reserve = sum(self._shortfall(r) for r in self.running)
                if not self.blocks.can_allocate(max(need, self._shortfall(req)) + reserve):
                    break
            elif not self.blocks.can_allocate(need):  # an empty batch admits on need alone
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = Status.RUNNING
            req.worker_known = True
            new_requests[req.req_id] = req.sampling
            req.pages += self.blocks.allocate(req.req_id, need)
            rows.append(self._attach_pages(req, row))
            budget -= row.num_tokens
            if reserve is not None:
                reserve += self._shortfall(req)  # what it still lacks, now that it runs
        by_id = {req.req_id: req for req in self.running}
        for row in rows:  # after every row has its pages, and every admission
            self._lookahead_pages(by_id[row.req_id], row)
        self._step_id += 1
        plan = StepPlan(self._step_id, rows, new_requests, self._dropped)
        self._dropped = []
        return plan

    def _decode_chain(self, reqs: list[Request]) -> int:
        """Decode steps of an ``ar`` batch's next plan (``SpecConfig.ar_chain``): no more than
        any request still wants, and within every request's room in the context."""
        k = min(self.policy.cfg.ar_chain, max(r.remaining_tokens for r in reqs))
        return max(1, min(k, min(self.max_model_len - r.num_tokens + 1 for r in reqs)))

    def _async_gammas(self, reqs: list[Request], caps: list[int], budget: int,
                      promised: dict[str, int]) -> dict[str, int] | None:  # fmt: skip
        """Each request's draft length for an asynchronous run (``SpecConfig.async_steps``),
        or None where none runs: a synchronized mode or no drafts, async_steps 1, or a step
        that may not fit the token budget (every request verifying at once, max(held, gamma)
        + 1 queries each). Sampled requests run too (``worker/sampled_rows.py``)."""
        spec = self.policy.cfg
        if not spec.speculative or spec.synchronized or spec.async_steps == 1:
            return None
        gammas = self.policy.targets(reqs, caps)
        if not spec.overlap_steps:  # nothing starts early: no promise to keep
            promised = {}
        # this run keeps the last run's promise (the worker may have started it with those);
        # the fresh choice is this run's promise for the next, its verifications on the slots
        # of that run (where each row's drafts held then follow from this run's schedule)
        held = [len(r.drafts) for r in reqs]
        keep = [self.policy.keeps_its_target(r, g)
                for r, g in zip(reqs, gammas, strict=True)] if self.policy.slotted else None
        steps = self._async_length(reqs)
        now = self.policy.align(gammas, held, self.decode_steps, caps, keep, steps)
        now = [min(promised.get(r.req_id, g), cap) for r, g, cap in zip(reqs, now, caps,
                                                                          strict=True)]
        if spec.verify_quantum > 1:  # per plan, and only with slots: the drafts held then
            held_next = [held_after(async_kinds(h, g, steps), h)
                         for h, g in zip(held, now, strict=True)]  # fmt: skip
            start = self.decode_steps + steps
            gammas = self.policy.align(gammas, held_next, start, caps, keep,
                                       self._async_length(reqs, start))  # fmt: skip
        for draft_lengths in (now, gammas):
            if sum(max(len(r.drafts), g) + 1
                   for r, g in zip(reqs, draft_lengths, strict=True)) > budget:  # fmt: skip
                return None
        self._promised = {r.req_id: g for r, g in zip(reqs, gammas, strict=True)}
        return {r.req_id: g for r, g in zip(reqs, now, strict=True)}

    def _async_length(self, reqs: list[Request], start: int | None = None) -> int:
        """Steps of an asynchronous run: no more than any request still wants (a step moves a
        request on by one position at most), within every request's room in the context.
        With verify slots, a run ends where the next one starts on a slot cycle (at a decode
        step that is a multiple of verify_quantum): rows in phase then draft k * quantum - 1
        tokens run after run. A run that starts off the cycle (after a warm-up, a prompt's
        steps) would otherwise start every run there, and a row's first slot within its query
        tile be the short one (quantum 8 from step 12: 3 drafts, run after run, where 7 were
        wanted). start: the run's first decode step (None: the next one); the run after this
        one is promised the length it would get at its start with the requests as they are
        (an upper bound: fewer steps near their ends drop the steps started early)."""
        spec = self.policy.cfg
        k = min(spec.async_steps, max(r.remaining_tokens for r in reqs))
        room = min(self.max_model_len - r.num_tokens - len(r.drafts) for r in reqs)
        k = max(1, min(k, room))
        start = self.decode_steps if start is None else start
        past = (start + k) % spec.verify_quantum  # steps past a cycle's start
        return k - past if k > past else k

    def _async_row(self, req: Request, gamma: int, steps: tuple[int, int],
                   next_gamma: int) -> RowPlan:  # fmt: skip
        """The request's row of an asynchronous run (``RowPlan.async_gamma``); steps: this
        run's and the next one's."""
        token = req.drafts[-1] if req.drafts else req.last_token
        return RowPlan(req.req_id, RowKind.DRAFT, [token], req.num_tokens - 1 + len(req.drafts),
                       0, [], num_steps=steps[0], verify_after=[req.last_token] + req.drafts,
                       async_gamma=gamma, next_async_gamma=next_gamma,
                       next_async_steps=steps[1])  # fmt: skip

    def lookahead_tokens(self, row: RowPlan) -> int:
        """KV tokens past the row's plan that the worker may write before the next plan
        comes: an asynchronous run's next ``async_overlap_steps`` steps (one position each),
        a greedy round's next round (``rounds_overlap``: its drafts and their verification),
        a decode chain's next chain (``ar_overlap``)."""
        spec = self.policy.cfg
        if row.async_gamma is not None:
            return spec.overlap_steps
        if row.verify_after is not None and spec.rounds_overlap:
            return row.num_steps + 1
        if row.kind == RowKind.VERIFY and row.num_steps > 1 and spec.ar_overlap:
            return row.num_steps  # a decode chain: the next chain of as many steps
        return 0

    def _lookahead_pages(self, req: Request, row: RowPlan) -> None:
        """Pages for the next plan's first steps (``lookahead_tokens``) on top of the row's,
        where free pages are left (never at the cost of a row or an admission: without them
        the worker does not start those steps early), sent with the row."""
        extra = self.lookahead_tokens(row)
        tokens = min(row.final_context_len + extra, self.max_model_len)
        need = self.blocks.pages_for(tokens) - len(req.pages)
        if extra and need > 0 and self.blocks.can_allocate(need):
            req.pages += self.blocks.allocate(req.req_id, need)
            row.pages_new = req.pages[row.pages_keep :]
            req.synced_pages = len(req.pages)

    def _rounds(self, reqs: list[Request], k: int) -> int:
        """Rounds of k drafts of a greedy synchronized batch in one plan
        (``SpecConfig.rounds_per_plan``): only when every request starts a round, no more
        than any request still wants, within every request's room in the context."""
        if any(r.drafts for r in reqs):
            return 1
        n = min(self.policy.cfg.rounds_per_plan,
                -(-max(r.remaining_tokens for r in reqs) // (k + 1)))  # fmt: skip
        room = min((self.max_model_len - r.num_tokens + 1) // (k + 1) for r in reqs)
        return max(1, min(n, room))

    def _row_for(self, req: Request, action: Action | None, budget: int, chain: int = 1,
                 verify_after: bool = False, rounds: int = 1) -> RowPlan | None:  # fmt: skip
        if req.in_prefill or action is None:
            n = min(req.num_tokens - req.num_computed, budget)
            if n <= 0:
                return None
            start = req.num_computed
            tokens = req.token_slice(start, start + n)
            return RowPlan(req.req_id, RowKind.PREFILL, tokens, start, 0, [],
                           sample=start + n == req.num_tokens)
        last = req.num_tokens - 1
        if action == Action.IDLE:
            return None
        if action == Action.DRAFT:
            token = req.drafts[-1] if req.drafts else req.last_token
            return RowPlan(req.req_id, RowKind.DRAFT, [token], last + len(req.drafts), 0, [],
                           num_steps=chain,
                           verify_after=[req.last_token] + req.drafts if verify_after else None,
                           num_rounds=rounds)  # fmt: skip
        tokens = [req.last_token] + req.drafts
        if len(tokens) > budget:
            return None
        return RowPlan(req.req_id, RowKind.VERIFY, tokens, last, 0, [],
                       num_drafts=len(req.drafts), num_steps=1 if req.drafts else chain)

    # ---- after the step ----------------------------------------------------------------------
    def update(self, plan: StepPlan, out: StepOutput, now: float | None = None) -> list[Request]:
        """The step's results into its running requests -> those that committed tokens (and
        perhaps finished). A request that stopped in an earlier round of its row drops the
        later rounds' tokens; one no longer running (aborted mid-step) is left alone."""
        now = time.time() if now is None else now
        running = {r.req_id: r for r in self.running}
        changed = []
        for row, res in zip(plan.rows, out.results, strict=True):
            req = running.get(row.req_id)
            if req is None:
                continue
            committed = False
            for round_row, result in rounds_of(row, res):  # several rounds: one at a time
                if req.status != Status.RUNNING:
                    break
                committed |= self._commit_row(req, round_row, result, now)
            if committed:
                changed.append(req)
            if req.status == Status.RUNNING:  # after all rounds: their KV is in these pages
                self.truncate_pages(req, self.lookahead_tokens(row))
        return changed

    def _commit_row(self, req: Request, row: RowPlan, res: RowResult, now: float) -> bool:
        """One row's (or round's) result into its request -> whether it committed tokens."""
        if row.kind == RowKind.DRAFT:  # one draft per step of the row (a chain: several)
            req.drafts += res.tokens
            req.metrics.drafted += len(res.tokens)
            req.metrics.decode_steps += len(res.tokens)
            if res.verified is None:
                return False
            # the chain ended its round: commit the verification that followed it
            row, res = row.verify_row(res.tokens), res.verified
        if row.kind == RowKind.PREFILL:
            req.num_computed += row.num_tokens
        else:
            self._account_verify(req, row, res)
            # a decode chain (ar) computed the KV of all its steps' inputs
            req.num_computed = row.start_pos + row.num_steps + res.num_accepted
            req.drafts = []
        if not res.tokens:
            return False
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        self._append(req, res.tokens)
        return True

    def _account_verify(self, req: Request, row: RowPlan, res: RowResult) -> None:
        d, a = row.num_drafts, res.num_accepted
        m = req.metrics
        m.decode_steps += row.num_steps
        self.policy.on_verified(req, d, a)
        if d == 0:
            return
        m.verifications += 1
        m.accepted += a
        m.gamma_history.append(d)
        while len(m.drafted_by_position) < d:
            m.drafted_by_position.append(0)
            m.accepted_by_position.append(0)
        for j in range(d):
            m.drafted_by_position[j] += 1
            m.accepted_by_position[j] += int(j < a)

    def _append(self, req: Request, tokens: list[int]) -> None:
        """Commit tokens, applying stop conditions to committed tokens only: the first stop
        token, or the token that reaches max_tokens or the context, ends the request and the
        tokens after it are dropped."""
        p = req.params
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= self.eos_token_ids
        if not p.stop:  # no stop strings: the end is found without decoding, in one pass
            room = min(p.max_tokens - len(req.output_token_ids),
                       self.max_model_len - req.num_tokens)  # fmt: skip
            at_length = max(room, 1) - 1  # the index whose commit reaches a length limit
            at_stop = next((i for i, t in enumerate(tokens) if t in stop_ids), len(tokens))
            end = min(at_stop, at_length, len(tokens) - 1)
            req.output_token_ids += tokens[: end + 1]
            req.metrics.generated_tokens += end + 1
            if at_stop == end:
                self.end(req, "stop")
            elif at_length == end:
                self.end(req, "length")
            return
        for token in tokens:  # stop strings: token by token, the text decides
            req.output_token_ids.append(token)
            req.metrics.generated_tokens += 1
            if token in stop_ids:
                self.end(req, "stop")
                break
            if p.stop:
                old_len = len(req.text)
                req.text = self.detok.update(req.decode_state, req.output_token_ids)
                hit = self.detok.find_stop(req.text, p.stop, old_len)
                if hit is not None:
                    start, stop = hit
                    req.text = req.text[: start + (len(stop) if p.include_stop_str_in_output
                                                  else 0)]
                    self.end(req, "stop", decode=False)
                    break
            if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                self.end(req, "length")
                break

    def _shortfall(self, req: Request) -> int:
        """Pages req lacks for its whole prompt (and committed tokens), its drafts and
        ``headroom_tokens`` more. Admission with headroom needs the new request's shortfall
        plus every running one's free; an empty batch admits on the first row's pages alone
        (nobody to keep room for; a request too large then preempts itself, never waits)."""
        tokens = req.num_tokens + len(req.drafts) + self.headroom_tokens
        return max(0, self.blocks.pages_for(tokens) - len(req.pages))

    def _ensure_pages(self, req: Request, context_len: int) -> bool:
        """Pages for req's row, preempting while they run out: among req and the requests
        with no row in this step yet, the one with the least KV computed (the cheapest to
        recompute; the newest on a tie). False if req itself was preempted."""
        need = self.blocks.pages_for(context_len) - len(req.pages)
        reclaimed = False
        while not self.blocks.can_allocate(need):
            if not reclaimed:  # the next plans' lookahead pages go before any request does
                reclaimed = True
                for other in self._unscheduled:
                    self.truncate_pages(other)
                continue
            candidates = [req, *self._unscheduled]
            victim = min(reversed(candidates), key=lambda r: r.num_computed)
            if victim is not req:
                self._unscheduled.remove(victim)
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.pages += self.blocks.allocate(req.req_id, need)
        return True

    def _attach_pages(self, req: Request, row: RowPlan) -> RowPlan:
        row.pages_keep = req.synced_pages
        row.pages_new = req.pages[req.synced_pages :]
        req.synced_pages = len(req.pages)
        return row
