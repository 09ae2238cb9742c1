"""``Scheduler.update`` (issue 19): every change of a request's state after a step, tested on
the CPU with plans and hand-made results, no model and no executor.

Invariants: a prefill chunk advances the KV length and its last chunk commits the sampled
token; drafts are held until a verification, which commits the accepted ones plus the target's
token, rolls the KV length back to them, returns the pages past them and teaches the policy;
stop tokens, max_tokens and the context end stop a request on a committed token and drop what
follows it in the same result; a request that left the batch mid-step is left alone."""

from __future__ import annotations

import pytest

from aspire_ray import SamplingParams
from aspire_ray.config import SchedulerConfig, SpecConfig
from aspire_ray.engine.block_manager import BlockManager
from aspire_ray.engine.request import Request, Status
from aspire_ray.engine.scheduler import Scheduler
from aspire_ray.plan import RowKind, RowResult, SamplingSpec, StepOutput, StepPlan
from aspire_ray.spec.draft_policy import DraftPolicy

PAGE = 16
EOS = 2


def _scheduler(mode: str = "ar", pages: int = 64, **spec) -> Scheduler:
    spec_cfg = SpecConfig(mode=mode, draft_chains=False, **spec)
    policy = DraftPolicy(spec_cfg, None, PAGE, num_layers=4)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=256), 4096,
                     BlockManager(pages, PAGE), policy, eos_token_ids={EOS})  # fmt: skip


def _add(sched: Scheduler, rid: str, prompt_len: int = 40, **params) -> Request:
    p = SamplingParams(max_tokens=params.pop("max_tokens", 20), temperature=0.0, **params)
    req = Request(rid, list(range(10, 10 + prompt_len)), p, SamplingSpec(0.0, 0, 1.0, 0), 0.0)
    sched.add(req)
    return req


def _answer(plan: StepPlan, per_row) -> StepOutput:
    """per_row(row) -> (tokens, num_accepted) for each row of the plan."""
    results = []
    for row in plan.rows:
        tokens, accepted = per_row(row)
        results.append(RowResult(row.req_id, row.kind, tokens, accepted))
    return StepOutput(plan.step_id, results)


def _prefilled(sched: Scheduler, req: Request, first: int = 100) -> None:
    plan = sched.schedule()
    assert [r.kind for r in plan.rows] == [RowKind.PREFILL] and plan.rows[0].sample
    changed = sched.update(plan, _answer(plan, lambda row: ([first], 0)))
    assert changed == [req]
    assert req.num_computed == len(req.prompt_token_ids) and req.output_token_ids == [first]


def test_prefill_then_decode_steps():
    sched = _scheduler("ar", ar_chain=1)
    req = _add(sched, "a")
    _prefilled(sched, req)
    plan = sched.schedule()
    row = plan.rows[0]
    assert row.kind == RowKind.VERIFY and row.token_ids == [100] and row.num_drafts == 0
    sched.update(plan, _answer(plan, lambda row: ([101], 0)))
    assert req.output_token_ids == [100, 101] and req.num_computed == 41
    assert req.metrics.decode_steps == 1 and req.metrics.first_token_time is not None


def test_chunked_prefill_commits_only_at_the_last_chunk():
    sched = _scheduler("ar", ar_chain=1)
    sched.cfg = SchedulerConfig(max_num_batched_tokens=32)
    req = _add(sched, "a", prompt_len=50)
    plan = sched.schedule()
    assert plan.rows[0].num_tokens == 32 and not plan.rows[0].sample
    assert sched.update(plan, _answer(plan, lambda row: ([], 0))) == []
    assert req.num_computed == 32 and req.output_token_ids == []
    plan = sched.schedule()
    assert plan.rows[0].sample
    sched.update(plan, _answer(plan, lambda row: ([7], 0)))
    assert req.num_computed == 50 and req.output_token_ids == [7]


def test_drafts_are_held_then_verified_and_rolled_back():
    sched = _scheduler("aspire_fixed", gamma=3)
    req = _add(sched, "a")
    _prefilled(sched, req)
    for i in range(3):  # synchronized: three draft steps, one token each
        plan = sched.schedule()
        assert [r.kind for r in plan.rows] == [RowKind.DRAFT]
        assert sched.update(plan, _answer(plan, lambda row, i=i: ([200 + i], 0))) == []
    assert req.drafts == [200, 201, 202] and req.metrics.drafted == 3
    pages_before = len(req.pages)
    plan = sched.schedule()
    row = plan.rows[0]
    assert row.kind == RowKind.VERIFY and row.token_ids == [100, 200, 201, 202]
    # the first draft accepted, the second rejected: the target's token replaces it
    changed = sched.update(plan, _answer(plan, lambda row: ([200, 300], 1)))
    assert changed == [req] and req.drafts == []
    assert req.output_token_ids == [100, 200, 300]
    assert req.num_computed == 40 + 1 + 1  # the prompt, the last token and the accepted draft
    assert req.metrics.verifications == 1 and req.metrics.accepted == 1
    assert req.metrics.gamma_history == [3]
    assert req.metrics.accepted_by_position == [1, 0, 0]
    assert req.alpha < SpecConfig().alpha_init  # the policy learned of the rejection
    assert len(req.pages) == sched.blocks.pages_for(req.num_computed) <= pages_before


def test_stop_token_finishes_and_drops_what_follows():
    sched = _scheduler("ar", ar_chain=4)
    req = _add(sched, "a")
    other = _add(sched, "b")
    _prefill_both(sched)
    plan = sched.schedule()
    assert [row.num_steps for row in plan.rows] == [4, 4]  # a decode chain of 4 steps

    def answer(row):  # a stops at its chain's 2nd token; b runs on
        return ([50, EOS, 51, 52], 0) if row.req_id == "a" else ([60, 61, 62, 63], 0)

    changed = sched.update(plan, _answer(plan, answer))
    assert changed == [req, other]
    assert req.status == Status.FINISHED and req.finish_reason == "stop"
    assert req.output_token_ids == [100, 50, EOS] and req.pages == []
    assert other.status == Status.RUNNING and other.output_token_ids == [100, 60, 61, 62, 63]
    assert other.num_computed == 40 + 4


def _prefill_both(sched: Scheduler) -> None:
    plan = sched.schedule()
    assert len(plan.rows) == 2
    sched.update(plan, _answer(plan, lambda row: ([100], 0)))


def test_max_tokens_and_ignore_eos():
    sched = _scheduler("ar", ar_chain=3)
    req = _add(sched, "a", max_tokens=3, ignore_eos=True)
    _prefilled(sched, req)
    plan = sched.schedule()
    sched.update(plan, _answer(plan, lambda row: ([EOS, 5, 6], 0)))  # EOS ignored
    assert req.status == Status.FINISHED and req.finish_reason == "length"
    assert req.output_token_ids == [100, EOS, 5]
    assert sched.blocks.num_used == 0


@pytest.mark.parametrize("stop", [["xy"]])
def test_stop_strings_need_the_detokenizer(stop):
    """A request with stop strings is checked on its text: the scheduler's detokenizer."""

    class Chars:  # a tokenizer of one character per token id
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(ord("a") + i % 26) for i in ids)

    from aspire_ray.engine.detokenizer import Detokenizer

    sched = _scheduler("ar", ar_chain=3)
    sched.detok = Detokenizer(Chars())
    req = _add(sched, "a", stop=stop)
    _prefilled(sched, req, first=0)
    plan = sched.schedule()
    sched.update(plan, _answer(plan, lambda row: ([23, 24, 25], 0)))  # "x", "y", "z"
    assert req.status == Status.FINISHED and req.finish_reason == "stop"
    assert req.output_token_ids == [0, 23, 24] and req.text == "a"


def test_a_request_that_left_mid_step_is_left_alone():
    sched = _scheduler("ar", ar_chain=1)
    req = _add(sched, "a")
    _prefilled(sched, req)
    plan = sched.schedule()
    sched.finish(req, "abort")
    assert sched.update(plan, _answer(plan, lambda row: ([5], 0))) == []
    assert req.output_token_ids == [100] and req.finish_reason == "abort"


def test_committing_without_stop_strings_ends_where_token_by_token_does():
    # requests without stop strings commit a result in one pass (no text to decode); it must
    # stop where the token-by-token path (stop strings, here one that never matches) stops:
    # the first stop token, max_tokens, or the context's end, whichever comes first
    import random

    rng = random.Random(0)
    for case in range(300):
        sched = _scheduler("ar", ar_chain=1)
        sched.max_model_len = rng.choice([4096, 47, 50])
        kw = dict(max_tokens=rng.randint(1, 9), stop_token_ids=rng.choice([[], [7]]),
                  ignore_eos=rng.random() < 0.3)  # fmt: skip
        fast, slow = _add(sched, "fast", **kw), _add(sched, "slow", stop=["\x00never"], **kw)
        before = rng.randint(0, 3)  # tokens committed already
        for req in (fast, slow):
            req.output_token_ids = [5] * before
        tokens = [rng.choice([EOS, 7, 11, 12, 13]) for _ in range(rng.randint(1, 8))]
        for req in (fast, slow):
            req.status = Status.RUNNING
            sched.running.append(req)
            sched._append(req, list(tokens))
        assert fast.output_token_ids == slow.output_token_ids, (case, kw, tokens)
        assert fast.finish_reason == slow.finish_reason, (case, kw, tokens)
        assert fast.metrics.generated_tokens == slow.metrics.generated_tokens
        assert fast.status == slow.status
