"""The small launches of a sampled step's choices (``kernels/choice_rows.py``) against their
torch references in ``worker/sampled_rows.py``, over random layouts of draft, verify, greedy
and padding rows (under Triton's interpreter without a GPU)."""

import pytest
import torch

from aspire_ray.kernels import choice_rows, race
from aspire_ray.plan import Stream
from aspire_ray.worker import sampled_rows as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_stream_numbers_are_the_plans():
    # the kernels' one home of the stream numbers (kernels/race.py) against the plan's
    assert (race.STREAM_TARGET, race.STREAM_DRAFT, race.STREAM_ACCEPT, race.STREAM_RESIDUAL) \
        == (Stream.TARGET, Stream.DRAFT, Stream.ACCEPT, Stream.RESIDUAL)  # fmt: skip
    assert (choice_rows.TARGET, choice_rows.DRAFT, choice_rows.RESIDUAL) \
        == (Stream.TARGET, Stream.DRAFT, Stream.RESIDUAL)  # fmt: skip


def _layout(seed: int, depth: int):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 40, (1,), generator=g))
    verify = torch.randint(0, 2, (n,), generator=g)
    held = torch.randint(0, depth, (n,), generator=g)
    queries = torch.where(verify > 0, held + 1, 1)
    padding_rows = int(torch.randint(0, 3, (1,), generator=g))  # rows of no query at the end
    queries[n - padding_rows:] = 0
    sampled = torch.rand(n, generator=g) < 0.7
    sampled[n - padding_rows:] = False
    qo = torch.cat([torch.zeros(1, dtype=torch.int64), queries.cumsum(0)]).to(torch.int32)
    t = int(qo[-1]) + int(torch.randint(0, 5, (1,), generator=g))  # padding queries
    params = (torch.rand(n, generator=g) + 0.5, torch.randint(0, 20, (n,), generator=g),
              torch.rand(n, generator=g))
    return g, n, t, qo, sampled, verify, held, params


@pytest.mark.parametrize("seed", range(8))
def test_the_launches_are_their_references(seed):
    depth = 9
    g, n, t, qo, sampled, verify, held, (temperature, top_k, top_p) = _layout(seed, depth)
    on = lambda *xs: [x.to(DEVICE) for x in xs]  # noqa: E731
    want = ref.query_layout_ref(qo, sampled, verify, held, temperature, top_k, top_p, t)
    got = choice_rows.query_layout(*on(qo, sampled, verify, held, temperature, top_k, top_p),
                                   t)  # fmt: skip
    for w, x in zip(want, got, strict=True):
        assert torch.equal(x.cpu(), w)
    row, j, live, _, _, _, checks, d = want
    # queries that test a draft reject it at random; the others hold d, as the test writes
    rejected_at = torch.where(checks & (torch.rand(t, generator=g) < 0.3), j, d[row])
    x_pos = torch.randint(100, 1000, (n,), generator=g)
    chain = torch.randint(0, 1000, (depth, n), generator=g)
    want = ref.row_draws_ref(qo, rejected_at, d, verify, sampled, held, x_pos, chain)
    got = choice_rows.row_draws(*on(qo, rejected_at, d, verify, sampled, held, x_pos, chain))
    for w, x in zip(want, got, strict=True):
        assert torch.equal(x.cpu(), w)
    a = want[0]
    argmax, token = torch.randint(0, 1000, (t,), generator=g), torch.randint(0, 1000, (t,))
    drawn = torch.randint(0, 1000, (n,), generator=g)
    want = ref.choose_ref(argmax, token, drawn, a, row, j, live, verify)
    got = choice_rows.choose(*on(argmax, token, drawn, a, row, j, live, verify))
    assert torch.equal(got.cpu(), want)
