"""Sampling: parameter validation, the counter-based sampler, rejection sampling keeps the
target distribution, seeded runs are deterministic and batch-independent."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import random_prompts
from scipy import stats

from aspire_ray import InvalidRequestError, SamplingParams
from aspire_ray.engine.engine import LLMEngine
from aspire_ray.llm import build_engine_config
from aspire_ray.plan import Stream
from aspire_ray.worker import sampler
from aspire_ray.worker.rejection_sampler import (
    SampledVerify,
    verify_greedy,
    verify_sampled,
    verify_sampled_batch,
)


@pytest.mark.parametrize("kwargs", [
    {"max_tokens": 0}, {"max_tokens": 1.5}, {"temperature": -0.1}, {"temperature": float("nan")},
    {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"seed": -1}, {"stop": ["x"] * 17},
    {"stop": [""]}, {"stop_token_ids": [-3]},
], ids=lambda kw: next(iter(kw)) + "=" + repr(next(iter(kw.values())))[:10])
def test_invalid_sampling_params_raise(kwargs):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_valid_sampling_params():
    p = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert p.stop == ["###"] and p.top_k == 0 and p.greedy


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token of zero probability"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return float(stats.chisquare(counts[keep], expected).pvalue)


def test_exponential_race_matches_distribution():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    n = 40_000
    seeds = torch.arange(n, dtype=torch.int64)
    tokens = sampler.sample_from_probs(probs.expand(n, -1), seeds, torch.full((n,), 7),
                                       Stream.TARGET)
    counts = np.bincount(tokens.numpy(), minlength=6)
    assert _chi2_pvalue(counts, probs.numpy()) > 1e-3


def test_uniform_depends_only_on_its_key():
    seeds, pos = torch.tensor([5, 5, 6]), torch.tensor([9, 9, 9])
    u = sampler.uniform(seeds, pos, Stream.ACCEPT, 4)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert not torch.equal(u, sampler.uniform(seeds, pos, Stream.DRAFT, 4))


def test_top_k_top_p_restrict_support():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 3)
    probs = sampler.probs_from_logits(
        logits, torch.ones(3), torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.5, 1.0]))
    assert (probs[0, 2:] == 0).all() and probs[0, :2].sum() == pytest.approx(1.0)
    assert (probs[1, 1:] == 0).all()  # top token alone holds >= 0.5 of the mass
    assert (probs[2] > 0).all()


def test_greedy_verification_prefix_plus_one():
    logits = torch.full((4, 5), -1.0)
    for j, t in enumerate([2, 3, 1, 4]):
        logits[j, t] = 1.0
    target = logits.argmax(-1).tolist()
    assert verify_greedy(target, [2, 3, 0]) == (2, [2, 3, 1])
    assert verify_greedy(target, [2, 3, 1]) == (3, [2, 3, 1, 4])
    assert verify_greedy(target[:1], []) == (0, [2])


def _toy_speculative_sequences(p: torch.Tensor, q: torch.Tensor, length: int, draft_len: int,
                               trials: int) -> np.ndarray:
    """Generate `length` tokens per trial by drafting from q and verifying against p
    (position-dependent, context-free toy models p[pos], q[pos])."""
    out = np.zeros((trials, length), dtype=np.int64)
    for trial in range(trials):
        seq: list[int] = []
        while len(seq) < length:
            pos0 = len(seq)
            d = min(draft_len, length - pos0 - 1)
            # the block's drafts in one call (each row drawn at its own (seed, position), as
            # the worker draws them a step at a time: the same tokens, at half the calls)
            drafts = sampler.sample_from_probs(q[pos0 : pos0 + d], torch.full((d,), trial),
                                               torch.arange(pos0, pos0 + d),
                                               Stream.DRAFT).tolist() if d else []  # fmt: skip
            _, tokens = verify_sampled(p[pos0 : pos0 + d + 1], q[pos0 : pos0 + d], drafts,
                                       seed=trial, pos0=pos0)
            seq += tokens
        out[trial] = seq[:length]
    return out


def test_batched_verification_equals_per_row():
    """The worker verifies a step's sampled rows in one batch; every row's accepted count and
    tokens must be exactly those of the per-row reference (same counters, same draws)."""
    gen = torch.Generator().manual_seed(0)
    vocab, outcomes = 40, set()
    for trial in range(25):
        draft_lens = [0, 1, 3, 6, 2, 0, 4]
        logit_rows, q_rows, rows, expected = [], [], [], []
        for i, d in enumerate(draft_lens):
            target = torch.softmax(2.0 * torch.randn(d + 1, vocab, generator=gen), dim=-1)
            # drafts close to the target: a mix of acceptances and rejections
            noisy = torch.log(target[:d]) + 0.7 * torch.randn(d, vocab, generator=gen)
            q = torch.softmax(noisy, dim=-1)
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(d)]
            seed, pos0 = 1000 * trial + i, 17 + 5 * i
            expected.append(verify_sampled(target, q, drafts, seed, pos0))
            rows.append(SampledVerify(sum(len(x) for x in logit_rows), drafts, seed, pos0))
            logit_rows.append(target)
            q_rows.append(q)
        probs = torch.cat(logit_rows)
        draft_probs = torch.cat(q_rows)
        assert verify_sampled_batch(probs, rows, draft_probs) == expected
        outcomes |= {("all" if a == len(r.drafts) else "rejected")
                     for (a, _), r in zip(expected, rows, strict=True) if r.drafts}
    assert outcomes == {"all", "rejected"}  # both ways of ending a block were exercised


def test_rejection_sampling_keeps_target_distribution():
    torch.manual_seed(0)
    vocab, length = 4, 3
    p = torch.softmax(torch.randn(length, vocab) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(length, vocab) * 1.5, dim=-1)  # a poor draft
    seqs = _toy_speculative_sequences(p, q, length, draft_len=2, trials=4000)
    joint = np.zeros([vocab] * length)
    for s in seqs:
        joint[tuple(s)] += 1
    target = np.ones([vocab] * length)
    for pos in range(length):
        shape = [1] * length
        shape[pos] = vocab
        target = target * p[pos].numpy().reshape(shape)
    assert _chi2_pvalue(joint.ravel(), target.ravel()) > 1e-3
    # deterministic under the seed
    again = _toy_speculative_sequences(p, q, length, draft_len=2, trials=50)
    assert np.array_equal(again, seqs[:50])


def _engine(model_dir, mode, **kw):
    cfg = build_engine_config(model_dir, spec_mode=mode, num_pages=200,
                              max_num_batched_tokens=256, k_min=3, recent_pages=1, **kw)
    return LLMEngine(cfg)


def _generate(engine, prompts, params):
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"q{i}", p, sp)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[f"q{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("mode", ["ar", "aspire"])
def test_seeded_sampling_is_deterministic_and_batch_independent(tiny_model_dir, mode):
    model_dir = tiny_model_dir("llama")
    prompt = random_prompts(1, [50], 256, seed=9)[0]
    sp = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    alone = _generate(_engine(model_dir, mode), [prompt], [sp])[0]
    others = random_prompts(5, [10, 70], 256, seed=10)
    mixed = _generate(_engine(model_dir, mode), others + [prompt],
                      [SamplingParams(max_tokens=15, temperature=1.0, ignore_eos=True)] * 5
                      + [sp])[-1]
    assert alone == mixed


def test_speculative_sampling_matches_ar_distribution(tiny_model_dir):
    """End to end: the first 3 generated tokens under `aspire` sampling follow the same
    distribution as plain sampling (two-sample chi-square over the observed sequences)."""
    model_dir = tiny_model_dir("qwen2")
    prompt = random_prompts(1, [40], 256, seed=11)[0]
    n = 200
    samples = {}
    for mode in ("ar", "aspire"):
        params = [SamplingParams(max_tokens=3, temperature=1.5, seed=s, ignore_eos=True)
                  for s in range(n)]
        samples[mode] = [tuple(t) for t in _generate(_engine(model_dir, mode, gamma_init=2),
                                                     [prompt] * n, params)]
    for pos in range(3):
        a = [s[pos] for s in samples["ar"]]
        b = [s[pos] for s in samples["aspire"]]
        tokens = sorted(set(a) | set(b))
        table = np.array([[a.count(t) for t in tokens], [b.count(t) for t in tokens]])
        # merge rare tokens so expected counts are not tiny
        common = table.sum(0) >= 10
        merged = np.column_stack([table[:, common], table[:, ~common].sum(1)])
        merged = merged[:, merged.sum(0) > 0]
        pvalue = stats.chi2_contingency(merged).pvalue
        assert pvalue > 1e-3, (pos, pvalue)


@pytest.mark.parametrize("mode,async_steps", [("aspire", 1), ("aspire", 16),
                                              ("aspire_fixed", 16)])  # fixed: draft chains
def test_pending_draft_probs_hold_only_their_own_rows(tiny_model_dir, mode, async_steps):
    """A pending draft's q owns exactly its own [V] row: not a view of its step's [N, V]
    probabilities, nor of the step's [k, V] gather of sampled draft rows (either keeps the
    other rows alive until this draft's request verifies, up to d_max steps later), nor of an
    asynchronous run's store of every row's q (async_steps > 1)."""
    engine = _engine(tiny_model_dir("llama"), mode, async_steps=async_steps)
    worker = engine.executor.worker
    vocab = engine.info.vocab_size
    prompts = random_prompts(4, [20, 60], 256, seed=3)
    held, mixed = 0, 0
    execute = worker.execute

    def checking(plan):
        nonlocal held, mixed
        out = execute(plan)
        drafts = sum(row.kind.name == "DRAFT" for row in plan.rows)
        mixed += drafts > 0 and any(row.kind.name == "VERIFY" or row.async_gamma is not None
                                    for row in plan.rows)  # a run mixes them step by step
        for req in worker.requests.values():
            for q in req.draft_probs:
                assert q.shape == (vocab,)
                rows = q.untyped_storage().nbytes() / (4 * vocab)  # float32 rows it keeps alive
                assert rows == 1, f"a pending q shares a buffer of {rows} rows"
                held += 1
        return out

    worker.execute = checking
    step = 0
    while prompts or engine.has_unfinished():
        if prompts and step % 2 == 0:  # staggered: requests draft and verify out of step
            engine.add_request(f"p{len(prompts)}", prompts.pop(), SamplingParams(
                max_tokens=24, temperature=0.9, seed=len(prompts), ignore_eos=True))
        engine.step()
        step += 1
    assert held > 0, "no pending draft held"
    if mode == "aspire":  # steps of draft rows beside verify rows (aspire_fixed: chains)
        assert mixed > 0, "no step mixed drafts and verifications"


@pytest.mark.parametrize("mode", ["aspire_fixed", "magicdec", "aspire"])
def test_a_large_steps_rows_are_sampled_in_runs_with_the_same_tokens(tiny_model_dir, mode,
                                                                      monkeypatch):  # fmt: skip
    """The host samples a planned step's rows (``Worker._sample``; an asynchronous run's step,
    ``async_runs._host_choices``) in runs of at most ``sampler.HOST_SAMPLE_ROWS`` logit rows,
    so that a step's sampling distributions and verified q never exist all at once: the same
    seeded tokens with runs of 5 as with one run a step (a verify row of more than 5 runs
    alone). The float32 logits too are made a run at a time (``Worker.logit_runs``): no
    [rows, V] of more than a run's rows, where the one-run engine made larger ones."""
    from aspire_ray.worker import async_runs

    model_dir = tiny_model_dir("llama")
    prompts = random_prompts(4, [20, 60], 256, seed=12)
    params = [SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=50 + i,
                             ignore_eos=True) for i in range(len(prompts))]  # fmt: skip

    def counted(fn, into):
        return lambda *a, **kw: into.append(1) or fn(*a, **kw)

    def logit_rows(engine) -> list[int]:  # the rows of every float32 logits the worker makes
        model, rows = engine.executor.worker.model, []
        made = model.compute_logits
        model.compute_logits = lambda hidden: rows.append(hidden.shape[0]) or made(hidden)
        return rows

    # the synchronized modes' rounds plan each draft step and the verification apart (their
    # chains sample on the device; a request near its end no longer splits a round into
    # plans of single steps): a verification of 4 rows of 6 queries is a planned step
    chains = {} if mode == "aspire" else {"draft_chains": False}
    first = _engine(model_dir, mode, gamma_init=4, **chains)
    rows_whole = logit_rows(first)
    whole = _generate(first, prompts, params)
    monkeypatch.setattr(sampler, "HOST_SAMPLE_ROWS", 5)
    engine = _engine(model_dir, mode, gamma_init=4, **chains)
    worker, runs, steps = engine.executor.worker, [], []
    rows_runs = logit_rows(engine)
    longest_row = worker.cfg.spec.max_drafts + 1  # a verify row's logits, alone in its run

    if mode == "aspire":  # its steps sampled in async_runs
        monkeypatch.setattr(async_runs, "host_choices", counted(async_runs.host_choices, runs))
        monkeypatch.setattr(async_runs, "_host_choices", counted(async_runs._host_choices, steps))
    else:
        worker._sample_run = counted(worker._sample_run, runs)
        worker._sample = counted(worker._sample, steps)
    assert _generate(engine, prompts, params) == whole
    assert len(runs) > len(steps) > 0  # steps were cut into runs
    assert max(rows_runs) <= max(5, longest_row) < max(rows_whole), (rows_runs, rows_whole)
