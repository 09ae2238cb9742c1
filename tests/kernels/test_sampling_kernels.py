"""The Triton sampling kernels (``kernels.race``, ``kernels.top_k_top_p``) against their torch
references in ``worker/sampler.py``: the exponential race draws the same token (its noise is
the reference's, bit for bit), the residual race falls back to p where the residual is empty,
and the top-k / top-p filter keeps the same tokens (ties at a cut kept) with the same
probabilities."""

import pytest
import torch

from aspire_ray.kernels.race import RACE_BLOCK, race_gathered, race_rows
from aspire_ray.kernels.top_k_top_p import filter_probs
from aspire_ray.plan import Stream
from aspire_ray.worker import sampler
from aspire_ray.worker.sampled_rows import draw_rows_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _keys(n: int, stream: int = Stream.TARGET) -> tuple[torch.Tensor, torch.Tensor]:
    seeds = torch.arange(100, 100 + n, dtype=torch.int64)
    return seeds, torch.arange(7, 7 + n, dtype=torch.int64) * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("v", [7, RACE_BLOCK, 2 * RACE_BLOCK + 333])
def test_the_race_draws_the_references_tokens(dtype, v):
    gen = torch.Generator().manual_seed(v)
    n = 12
    w = torch.softmax(3 * torch.randn(n, v, generator=gen), dim=-1).to(dtype)
    w[1] = 0.0  # no weight anywhere: every ratio 0, the first column
    w[2, : v // 2] = 0.0  # the mass in the row's later chunks
    w[3] = 1.0 / v  # uniform
    seeds, positions = _keys(n)
    ref = sampler.race_ref(w, seeds, positions, Stream.DRAFT)
    got = race_rows(w.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE), Stream.DRAFT)
    assert torch.equal(got.cpu(), ref)
    assert ref[1] == 0


def test_the_race_takes_a_stream_per_row_wide_seeds_and_strided_rows():
    gen = torch.Generator().manual_seed(3)
    padded = torch.rand(6, 1000, generator=gen)
    w = padded[:, :900]  # rows 1,000 apart, 900 columns
    seeds, positions = _keys(6)
    seeds[2:4] = torch.tensor([2**40 + 5, 2**62 + 2**33])  # the seed's high word counts too
    positions[4] = 2**35 + 1  # only its low 32 bits do
    stream = torch.tensor([1, 2, 3, 1, 2, 3])
    ref = sampler.race_ref(w, seeds, positions, stream)
    got = race_rows(w.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE), stream.to(DEVICE))
    assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("case", ["peaked", "tiny", "subnormal", "scales", "near_ties"])
def test_float32_candidates_settle_to_the_float64_draws(case):
    # float32 weights: each chunk's float32 ratios pick the candidates and float64 settles
    # them (kernels/race.py _chunk_best): the same tokens as the float64 reference, for
    # peaked rows (one ratio far ahead), weights too small for float32 quotients (the chunk's
    # float64 race whole, subnormal ones included) and rows of every scale between
    gen = torch.Generator().manual_seed(len(case))
    n, v = 24, 2 * RACE_BLOCK + 501
    if case == "peaked":
        w = torch.softmax(8 * torch.randn(n, v, generator=gen), dim=-1)
    elif case == "tiny":
        w = torch.rand(n, v, generator=gen) * 1e-33
        w[::3] *= 1e-8  # subnormal float32 weights
    elif case == "subnormal":  # a few bits each: float32 quotients lose their order
        w = torch.randint(1, 64, (n, v), generator=gen).float() * 2.0**-149
    elif case == "near_ties":  # two columns a row whose float64 ratios differ by ~1e-9
        w = torch.rand(n, v, generator=gen) * 1e-12  # far below the pair's ratios
        seeds, positions = _keys(n)
        expo = -torch.log(sampler.uniform(seeds, positions, Stream.TARGET, v))  # float64
        for r in range(n):
            a, b = 5 + 7 * r, RACE_BLOCK - 3 - 5 * r  # one chunk
            w[r, a] = 0.5
            # b's weight so that its ratio is a's times 1 +- 1e-9 (the sign by row): as a
            # float32 weight, within float32's resolution of a's either way
            target = 0.5 * float(expo[r, b] / expo[r, a]) * (1 + (1e-9 if r % 2 else -1e-9))
            w[r, b] = target
    else:
        w = torch.rand(n, v, generator=gen) * 10.0 ** -torch.randint(0, 44, (n, 1), generator=gen)
        w[:, RACE_BLOCK : 2 * RACE_BLOCK] *= (torch.rand(n, 1, generator=gen) < 0.5)  # zero chunks
    seeds, positions = _keys(n)
    ref = sampler.race_ref(w, seeds, positions, Stream.TARGET)
    got = race_rows(w.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE), Stream.TARGET)
    assert torch.equal(got.cpu(), ref)


def test_the_residual_race_and_its_fallback_match_the_reference():
    gen = torch.Generator().manual_seed(5)
    n, v = 8, RACE_BLOCK + 100
    p = torch.softmax(2 * torch.randn(n, v, generator=gen), dim=-1)
    q = torch.softmax(torch.log(p) + 0.8 * torch.randn(n, v, generator=gen), dim=-1)
    q[2] = p[2]  # q == p: the residual is all zero, the draw falls back to p
    q[3] = p[3] * 2  # q >= p everywhere: again p
    use = torch.tensor([True, True, True, True, False, False, True, False])
    seeds, positions = _keys(n)
    stream = torch.where(use, int(Stream.RESIDUAL), int(Stream.TARGET))
    ref = sampler.sample_residual(p, q, use, seeds, positions, stream)
    got = race_rows(p.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE), stream.to(DEVICE),
                    q.to(DEVICE), use.to(DEVICE))  # fmt: skip
    assert torch.equal(got.cpu(), ref)
    plain = sampler.race_ref(p, seeds, positions, stream)  # rows that race p itself
    assert torch.equal(ref[[2, 3, 4, 5, 7]], plain[[2, 3, 4, 5, 7]])
    residual = (p - q).clamp_min(0)
    assert (residual[[0, 1, 6]].gather(1, ref[[0, 1, 6], None]) > 0).all()


def test_the_gathered_race_draws_and_keeps_as_its_reference():
    """``race_gathered`` (rows read where they lie, a column excluded, a draft's q kept)
    against ``draw_rows_ref``'s gathers: the same draws and the same store after."""
    gen = torch.Generator().manual_seed(11)
    t, n, depth, v = 9, 6, 3, RACE_BLOCK + 100
    probs = torch.softmax(2 * torch.randn(t, v, generator=gen), dim=-1)
    store = torch.softmax(2 * torch.randn(depth, n + 2, v, generator=gen), dim=-1)
    rows = torch.tensor([4, 0, 4, 8, 2, 7])
    planes = torch.tensor([0, 2, 1, 0, 2, 1])
    use = torch.tensor([True, False, True, False, True, False])
    store[2, 4] = 2 * probs[2]  # q >= p: row 4's residual is empty, it falls back to p
    seeds, positions = _keys(n)
    stream = torch.where(use, int(Stream.RESIDUAL), int(Stream.DRAFT))
    plain = sampler.race_ref(probs[rows], seeds, positions, stream)
    # rows 1 and 4 lose the token they would draw from p; row 3 excludes nothing
    exclude = torch.tensor([-1, int(plain[1]), 5, -1, int(plain[4]), 7])
    keep = torch.tensor([1, 0, -1, 2, 0, -1])  # never the plane a residual row reads
    ref_store = store.clone()
    ref = draw_rows_ref(probs, rows, ref_store, planes, keep, exclude, use, seeds, positions,
                        stream)  # fmt: skip
    got_store = store.to(DEVICE)
    got = race_gathered(probs.to(DEVICE), rows.to(DEVICE), got_store, planes.to(DEVICE),
                        keep.to(DEVICE), exclude.to(DEVICE), use.to(DEVICE), seeds.to(DEVICE),
                        positions.to(DEVICE), stream.to(DEVICE))  # fmt: skip
    assert torch.equal(got.cpu(), ref)
    assert torch.equal(got_store.cpu(), ref_store)
    assert ref[1] != plain[1] and ref[4] != plain[4]  # the exclusion was read
    assert torch.equal(ref_store[1, 0], probs[4]) and ref_store[0, 1, plain[1]] == 0
    assert torch.equal(ref_store[:, [2, 5, 6, 7]], store[:, [2, 5, 6, 7]])  # keep -1: untouched


def _filter_case(n: int, v: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = 4 * torch.randn(n, v, generator=gen)
    logits[1, :40] = logits[1].max() + 1  # 40 tied top tokens: a top-k cut of 5 keeps all 40
    logits[2, 10:20] = logits[2].max() + 1  # 10 tied at the top, the rest below
    return logits


@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("v", [300, 5000])
def test_the_filter_keeps_the_references_tokens(need, v):
    n = 8
    logits = _filter_case(n, v, seed=v)
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.5, 2.0, 1.0, 0.9, 1.0])
    top_k = torch.tensor([0, 5, 3, 1, 50, v, v + 7, 20])
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 0.3, 0.99, 1.0, 1e-4])
    need_k, need_p = need
    ref = sampler.probs_from_logits_ref(logits, temperature, top_k, top_p, need_k, need_p)
    got = filter_probs(logits.to(DEVICE), temperature.to(DEVICE), top_k.to(DEVICE),
                       top_p.to(DEVICE), need_k, need_p).cpu()  # fmt: skip
    assert torch.equal(got > 0, ref > 0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.sum(-1), torch.ones(n), rtol=1e-5, atol=0)
    if need_k:
        assert (ref[1] > 0).sum() == 40  # ties at the k-th value are kept
        assert (ref[2] > 0).sum() <= 10 and (ref[3] > 0).sum() == 1
    if need_p and not need_k:
        assert (ref[7] > 0).sum() == 1  # top_p tiny: the top token alone


@pytest.mark.parametrize("ways, full_passes", [(8, 1), (2, 4), (8, 12)])
def test_the_filter_finishes_over_candidates_or_the_whole_row(ways, full_passes):
    """A search's last passes run over the compacted candidates, or over the whole row where a
    chunk holds more than CAP of them: a nearly flat row (every e within 1e-3 of the top) has
    thousands; the result is the reference's either way, however the passes are split."""
    n, v = 4, 5000
    logits = _filter_case(n, v, seed=11)
    logits[0] = 1e-3 * torch.randn(v, generator=torch.Generator().manual_seed(2))
    logits[3] = logits[0]
    args = (torch.ones(n), torch.tensor([0, 30, 0, 2000]), torch.tensor([0.9, 0.6, 0.5, 0.7]))
    ref = sampler.probs_from_logits_ref(logits, *args, True, True)
    got = filter_probs(logits.to(DEVICE), *(a.to(DEVICE) for a in args), True, True,
                       ways=ways, full_passes=full_passes).cpu()  # fmt: skip
    assert torch.equal(got > 0, ref > 0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    assert 4000 < (ref[0] > 0).sum() < 5000 and (ref[3] > 0).sum() <= 2000


def test_the_filter_reads_bf16_logits_and_rejects_bad_input():
    logits = _filter_case(4, 700, seed=1).to(torch.bfloat16)
    args = (torch.ones(4), torch.tensor([0, 3, 0, 9]), torch.tensor([0.8, 1.0, 1.0, 0.6]))
    ref = sampler.probs_from_logits_ref(logits, *args, True, True)
    got = filter_probs(logits.to(DEVICE), *(a.to(DEVICE) for a in args), True, True).cpu()
    assert torch.equal(got > 0, ref > 0)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="top_k must be"):
        filter_probs(logits.to(DEVICE), *(a.to(DEVICE) for a in args[:1]),
                     torch.zeros(4, dtype=torch.int32, device=DEVICE), args[2].to(DEVICE),
                     True, True)  # fmt: skip
    with pytest.raises(ValueError, match="contiguous last dim"):
        race_rows(torch.zeros(5, 3, device=DEVICE).t(), *(torch.zeros(3, dtype=torch.int64),) * 2,
                  Stream.TARGET)  # fmt: skip
    with pytest.raises(ValueError, match="minus must match"):
        race_rows(torch.zeros(2, 3, device=DEVICE),
                  *(torch.zeros(2, dtype=torch.int64, device=DEVICE),) * 2, Stream.TARGET,
                  torch.zeros(2, 4, device=DEVICE), torch.ones(2, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="seeds must be int64"):
        race_rows(torch.zeros(2, 3, device=DEVICE), torch.zeros(2, device=DEVICE),
                  torch.zeros(2, dtype=torch.int64, device=DEVICE), Stream.TARGET)


@pytest.mark.parametrize("t", [5, 300])
def test_the_acceptance_test_is_the_references(t):
    # kernels/accept.py against sampled_rows.rejected_at_ref: the same uniform (bit for bit),
    # the same rejections; queries that test no draft take their row's held count
    from aspire_ray.kernels.accept import rejected_at
    from aspire_ray.worker.sampled_rows import rejected_at_ref

    gen = torch.Generator().manual_seed(t)
    n, depth, v = 7, 4, 333
    probs = torch.softmax(2 * torch.randn(t, v, generator=gen), dim=-1)
    q_store = torch.softmax(2 * torch.randn(depth, n, v, generator=gen), dim=-1)
    chain = torch.randint(0, v, (depth, n), generator=gen)
    row = torch.randint(0, n, (t,), generator=gen)
    j = torch.randint(0, depth + 2, (t,), generator=gen)  # past the depth: clamped
    held = torch.randint(0, depth + 1, (n,), generator=gen)
    checks = (j < held[row]) & (torch.rand(t, generator=gen) < 0.9)
    seed = torch.randint(0, 2**40, (n,), generator=gen)
    x_pos = torch.randint(0, 10**6, (n,), generator=gen)
    args = (probs, q_store, chain, row, j, checks, seed, x_pos, held)
    ref = rejected_at_ref(*args)
    got = rejected_at(*(x.to(DEVICE) for x in args))
    assert torch.equal(got[0].cpu(), ref[0]) and torch.equal(got[1].cpu(), ref[1])
    if t > 100:  # both outcomes
        rejected = ref[0] != held[row]
        assert 0 < int(rejected.sum()) < int(checks.sum())
