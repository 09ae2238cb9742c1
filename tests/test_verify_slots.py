"""Verify slots (``SpecConfig.verify_quantum``): in the modes where each request verifies at its
own pace, verifications land on every Q-th decode step only, so that the steps between hold
draft rows alone (a step mixing verify and draft rows costs more than the two apart:
docs/benchmarks.md §8.28). The draft lengths move to the nearest ones that land on a slot; the
tokens do not change (greedy output equals `ar`'s)."""

from __future__ import annotations

import pytest
from fake_executor import FakeExecutor
from helpers import random_prompts, run_staggered

from aspire_ray import SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config
from aspire_ray.plan import RowKind, async_kinds, held_after
from aspire_ray.spec.draft_policy import DraftPolicy, aligned_gamma, run_gamma


def test_aligned_gamma_lands_the_verification_on_a_slot():
    # slots of quantum 3: steps 2, 5, 8, ...; a row verifies at step + gamma - held
    for step in range(7):
        for held in range(4):
            for gamma in range(1, 9):
                g = aligned_gamma(gamma, held, step, 3, cap=16)
                # of the lengths whose verification lands on a slot, none below the drafts
                # already held, the nearest (a tie: the longer)
                landing = [c for c in range(max(held, 1), 17) if (step + c - held) % 3 == 2]
                assert g == min(landing, key=lambda c: (abs(c - gamma), -c)), (step, held, g)
                assert abs(g - gamma) <= 1 or gamma < held + 2
    # in phase (drafting since the step after a slot): lengths k * 3 - 1, kept run after run
    assert [aligned_gamma(g, 0, 3, 3, 16) for g in range(1, 9)] == [2, 2, 2, 5, 5, 5, 8, 8]
    assert aligned_gamma(4, 0, 0, 3, 16) == 5  # a tie goes to the longer
    assert aligned_gamma(0, 0, 1, 3, 16) == 0  # plain decoding stays plain
    assert aligned_gamma(5, 0, 0, 3, cap=1) == 1  # no slot within the cap: the cap


def test_align_stays_within_the_query_tile_and_off_for_rounds():
    def policy(mode, tile):
        cfg = build_engine_config("dummy", load_format="dummy", spec_mode=mode,
                                  verify_quantum=4, calibrate="off").spec  # fmt: skip
        return DraftPolicy(cfg, None, 16, 4, tile)

    # quantum 4 in phase: 3, 7, 11, 15; a target of 8 moves to 7, of 9 to 11 (one tile of 16)
    assert policy("aspire", 16).align([8, 9], [0, 0], 4, [16, 16]) == [7, 11]
    # with a tile of 9 queries 11 would read the KV twice: 9 stays within its tile (7)
    assert policy("aspire", 9).align([8, 9], [0, 0], 4, [16, 16]) == [7, 7]
    assert policy("aspire_fixed", 9).align([8, 9], [0, 0], 4, [16, 16]) == [8, 9]


def test_the_default_slots_follow_the_query_tile():
    def quantum(tile, **spec):
        cfg = build_engine_config("dummy", load_format="dummy", spec_mode="aspire",
                                  calibrate="off", **spec).spec  # fmt: skip
        assert cfg.verify_quantum == spec.get("verify_quantum")  # None: set by the tile
        return DraftPolicy(cfg, None, 16, 4, tile).cfg.verify_quantum

    # Qwen2.5's 7-head groups in 64-row tiles: 9 queries a KV read, rows in phase draft 8
    assert quantum(9) == 9
    policy = DraftPolicy(build_engine_config("dummy", load_format="dummy", spec_mode="aspire",
                                             calibrate="off").spec, None, 16, 4, 9)  # fmt: skip
    assert policy.align([8, 6, 11], [0, 0, 0], 9, [16, 16, 16]) == [8, 8, 8]
    # no tile modelled, one wider than d_max + 1 queries (SmolLM2's 3-head groups: 21) or of
    # one query: every second step, as before
    assert quantum(None) == quantum(21) == quantum(1) == 2
    assert quantum(17) == 17 and quantum(18) == 2  # d_max 16: 17 queries at most
    assert quantum(21, d_max=20) == 21
    # set explicitly, it stands whatever the tile
    assert quantum(9, verify_quantum=4) == 4 and quantum(9, verify_quantum=1) == 1
    # the engine's policy takes the tile its workers report
    cfg = build_engine_config("dummy", load_format="dummy", spec_mode="aspire", calibrate="off",
                              k_min=3, recent_pages=1)  # fmt: skip
    engine = LLMEngine(cfg, executor=FakeExecutor(cfg, info={"query_tile_tokens": 9}))
    assert engine.scheduler.policy.cfg.verify_quantum == 9


def _verify_steps(quantum: int, async_steps: int, temperature: float = 0.0, seed: int | None = 1,
                  tile: int | None = None, **spec) -> tuple[list[int], LLMEngine]:  # fmt: skip
    """Decode-step indices of every verification of 4 requests (aspire_fsm: the fake executor
    accepts every draft, so the draft lengths grow from 5; tile: the query tile the worker
    reports)."""
    spec = {"fsm_max": 10, "max_num_batched_tokens": 64, **spec}
    cfg = build_engine_config("dummy", load_format="dummy", spec_mode="aspire_fsm",
                              calibrate="off", async_steps=async_steps,
                              verify_quantum=quantum, k_min=3, recent_pages=1,
                              **spec)  # fmt: skip
    info = {} if tile is None else {"query_tile_tokens": tile}
    engine = LLMEngine(cfg, executor=FakeExecutor(cfg, info=info))
    sched, steps = engine.scheduler, []
    execute = engine.executor.execute

    def recording(plan):
        start = sched.decode_steps - max((r.num_steps for r in plan.rows
                                          if r.async_gamma is not None), default=1)  # fmt: skip
        for row in plan.rows:
            if row.async_gamma is not None:
                kinds = row.async_kinds()
            elif row.kind == RowKind.VERIFY:
                kinds = [row.num_drafts]
            else:
                continue
            steps.extend(start + i for i, k in enumerate(kinds) if k >= 0)
        return execute(plan)

    engine.executor.execute = recording
    # requests that start decoding at different steps (prompts of different lengths, one
    # prefill chunk a step): out of phase at first
    params = SamplingParams(max_tokens=150, temperature=temperature, seed=seed, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", [(3 * i + j) % 256 for j in range(40 + 90 * i)], params)
    while engine.has_unfinished():
        engine.step()
    return steps, engine


@pytest.mark.parametrize("async_steps", [1, 6])
def test_verifications_fall_on_the_slots(async_steps):
    on, _ = _verify_steps(3, async_steps)
    off, _ = _verify_steps(1, async_steps)
    share = lambda steps: sum(s % 3 == 2 for s in steps) / len(steps)  # noqa: E731
    # the last verifications may come early (a request's last tokens cap its drafts)
    assert len(on) > 40 and share(on) >= 0.85, sorted(on)
    assert share(off) < 0.5  # without slots: a third of them by chance


def test_a_row_out_of_phase_where_a_cycle_starts_comes_back_in_a_run_or_two():
    # Qwen2.5's slots (quantum 9 = its query tile: 8 drafts at most). A row holding h drafts
    # where a cycle starts would need h + 8 to verify on the cycle's slot; aligned_gamma kept
    # its length and the row verified off the slots in every run after (docs/benchmarks.md
    # §8.61). run_gamma takes it back: with 5 held, rounds of 6 (off the slot once, then on it)
    assert aligned_gamma(8, 5, 9, 9, cap=8) == 8  # no slot in one round: kept, off for good
    assert run_gamma(8, 5, 9, 9, cap=8, steps=9) == 6
    # in phase, whatever the target: 8, on the slot (the lengths between would verify off it)
    assert [run_gamma(g, 0, 9, 9, cap=8, steps=9) for g in (1, 3, 8)] == [8, 8, 8]
    assert run_gamma(0, 3, 9, 9, cap=8, steps=9) == 0  # plain decoding stays plain
    for held in range(9):  # every state where a cycle starts: in phase within two runs
        h, offs = held, []
        for run in range(6):
            g = run_gamma(8, h, 9 * (run + 1), 9, cap=8, steps=9)
            kinds = async_kinds(h, g, 9)
            offs.append(sum(k >= 0 and i != 8 for i, k in enumerate(kinds)))
            h = held_after(kinds, h)
        assert sum(offs[2:]) == 0 and h == 0, (held, offs)
        assert sum(offs) <= 2, (held, offs)


def test_rows_that_start_out_of_phase_verify_on_the_slots_of_a_query_tile():
    # requests that start decoding at different steps hold different drafts where the first
    # cycle starts; with slots as wide as the query tile (no length of 9 or more drafts) they
    # still end up verifying on the slots
    steps, _ = _verify_steps(9, 16, tile=9, fsm_max=8, max_num_batched_tokens=128)
    late = sorted(steps)[len(steps) // 3:]  # after the first runs
    on = sum(s % 9 == 8 for s in late) / len(late)
    assert len(late) > 20 and on >= 0.9, sorted(steps)


def test_seeded_sampled_requests_take_the_slots_only_when_asked():
    # a seeded sampled request keeps its own draft lengths (its text follows them), unless
    # SpecConfig.slot_sampled moves them to the slots as greedy ones; a request without a
    # seed promises no text and takes them either way
    share = lambda steps: sum(s % 3 == 2 for s in steps) / len(steps)  # noqa: E731
    own, _ = _verify_steps(3, 6, temperature=0.8)
    slotted, _ = _verify_steps(3, 6, temperature=0.8, slot_sampled=True)
    unseeded, _ = _verify_steps(3, 6, temperature=0.8, seed=None)
    for steps in (slotted, unseeded):
        assert len(steps) > 40 and share(steps) >= 0.85, sorted(steps)
    assert share(own) < 0.5


def test_verify_slots_keep_the_tokens(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompts = random_prompts(4, [8, 24, 40], vocab=256, seed=4)
    # long enough that `aspire`, whose cost model finds little to gain at these contexts, still
    # drafts often (its first rounds, then a probe every probe_every plain verifications)
    params = [SamplingParams(max_tokens=32 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(4)]  # fmt: skip

    def run(mode, **spec):
        cfg = build_engine_config(model_dir, spec_mode=mode, max_num_batched_tokens=64,
                                  num_pages=120, max_num_seqs=4, page_size=4, calibrate="off",
                                  k_min=3, recent_pages=1, d_max=6, gamma_init=3,
                                  **spec)  # fmt: skip
        engine = LLMEngine(cfg)
        drafted = []  # each verification's draft count
        update = engine.scheduler.policy.on_verified
        engine.scheduler.policy.on_verified = lambda req, d, a: (drafted.append(d),
                                                                 update(req, d, a))
        return run_staggered(engine, prompts, params, arrive_every=2), drafted

    expected, _ = run("ar")
    # 7 = d_max + 1: the default's quantum where the tile holds d_max + 1 queries
    for mode, quantum in (("aspire", 3), ("aspire_fsm", 4), ("aspire", 7)):
        out, drafted = run(mode, verify_quantum=quantum, async_steps=6)
        assert out == expected, mode
        assert sum(d > 0 for d in drafted) >= 8, drafted  # it drafted and verified


def test_async_kinds_of_an_aligned_row_verify_on_slots():
    # a row in phase at step 9 (slots 11, 14, 17, ...) with length 2: verifies every third step
    g = aligned_gamma(3, 0, 9, 3, 16)
    assert g == 2
    kinds = async_kinds(0, g, 9)
    assert [9 + i for i, k in enumerate(kinds) if k >= 0] == [11, 14, 17]


def test_runs_end_on_the_slot_cycle_and_keep_its_draft_lengths():
    # a batch that starts its runs off the cycle (decode step 12 of quantum 8, as after a
    # warm-up): the first run ends where a cycle starts, every later run starts on one, and
    # the rows draft 7 (= 8 - 1) run after run. Before, every run started at step 12 + 16k
    # and the first slot within the 9-query tile was 3 drafts away: 3, run after run.
    cfg = build_engine_config("dummy", load_format="dummy", spec_mode="aspire_fsm",
                              calibrate="off", fsm_min=7, fsm_max=7, verify_quantum=8,
                              async_steps=16, k_min=3, recent_pages=1)  # fmt: skip
    engine = LLMEngine(cfg, executor=FakeExecutor(cfg, info={"query_tile_tokens": 9}))
    sched = engine.scheduler
    sched.decode_steps = 12
    runs = []  # (first decode step, steps, each row's draft length, next run's steps)
    execute = engine.executor.execute

    def recording(plan):
        rows = [r for r in plan.rows if r.async_gamma is not None]
        if rows:
            steps = rows[0].num_steps
            runs.append((sched.decode_steps - steps, steps, {r.async_gamma for r in rows},
                         rows[0].next_async_steps))  # fmt: skip
        return execute(plan)

    engine.executor.execute = recording
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [(7 * i + j) % 256 for j in range(64)], params)
    while engine.has_unfinished():
        engine.step()
    first, later = runs[0], runs[1:-2]  # the last runs: requests near their ends
    assert (first[0] + first[1]) % 8 == 0  # the first run ends where a cycle starts
    assert len(later) >= 4 and all(start % 8 == 0 and steps == 16 for start, steps, _, _ in later)
    assert all(gammas == {7} for _, _, gammas, _ in later), runs
    # each run promised the next one's length (the worker starts it early with that many)
    assert all(run[3] == nxt[1] for run, nxt in zip(runs[:-3], runs[1:-2], strict=True))
