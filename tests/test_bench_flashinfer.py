"""scripts/bench_flashinfer.py: its inputs, byte counts and result tables on the CPU, its exit
without a GPU, and one small whole run on a CUDA GPU with flashinfer (skipped elsewhere)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import SCRIPTS, scripts_imported

from aspire_ray.kernels.metadata import PagedKVMeta
from aspire_ray.worker.rejection_sampler import verify_sampled_batch


@pytest.fixture(scope="module")
def bf():
    with scripts_imported("bench_flashinfer") as (module,):
        yield module


def _rows(bf, specs, page_size=16, seed=0):
    return bf.step_rows(specs, page_size, torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("page_size", [1, 16], ids=["ps1", "ps16"])
def test_step_rows_own_pages_and_sparse_subsets(bf, page_size):
    specs = [(6, 100, 1.0), (1, 1000, 0.1), (1, 37, 0.5), (1, 16, 0.07)]
    full = _rows(bf, [(n, ctx, 1.0) for n, ctx, _ in specs], page_size)
    rows = _rows(bf, specs, page_size)  # same seed: the same pages per row before the subsets
    sizes = [math.ceil(ctx / page_size) for _, ctx, _ in specs]
    assert rows.num_pages == full.num_pages == sum(sizes)
    listed = [p for pages in full.page_lists for p in pages]
    assert sorted(listed) == list(range(sum(sizes)))  # every row on its own pages
    assert full.kv_lens == [ctx for _, ctx, _ in specs]
    assert rows.q_lens == [6, 1, 1, 1]
    for (_, ctx, frac), n, whole, part, kv_len in zip(
        specs, sizes, full.page_lists, rows.page_lists, rows.kv_lens, strict=True
    ):
        assert len(part) == max(1, math.ceil(frac * n))
        assert part[-1] == whole[-1]  # the last page (maybe partial) is kept, last
        positions = [whole.index(p) for p in part]
        assert positions == sorted(set(positions))  # a subsequence of the row's pages
        assert kv_len == (len(part) - 1) * page_size + ctx - (n - 1) * page_size
    PagedKVMeta.build(rows.q_lens, rows.page_lists, rows.kv_lens, page_size)  # valid metadata


def test_part_rows(bf):
    a = bf.parse_args(["--verify-q", "6", "--mixed-verify", "0.25", "--sparse-frac", "0.1"])
    gen = torch.Generator().manual_seed(0)
    assert bf.part_rows("decode", 4, 160, a, gen).q_lens == [1] * 4
    assert bf.part_rows("verify", 4, 160, a, gen).q_lens == [6] * 4
    mixed = bf.part_rows("mixed", 16, 1600, a, gen)
    assert mixed.q_lens == [6] * 4 + [1] * 12
    assert [len(p) for p in mixed.page_lists] == [100] * 4 + [10] * 12
    assert mixed.kv_lens == [1600] * 4 + [160] * 12


def test_attention_bytes_by_hand(bf):
    rows = bf.Rows(q_lens=[6, 1], page_lists=[[0], [1]], kv_lens=[100, 37], num_pages=2)
    # K and V: 137 tokens x 2 x 2 kv heads x 64; q and out: 7 tokens x 2 x 14 heads x 64; bf16
    assert bf.attention_bytes(rows, 14, 2, 64, 2) == (137 * 2 * 2 * 64 + 7 * 2 * 14 * 64) * 2
    assert bf.tensor_bytes(torch.zeros(3, 5), torch.zeros(2, dtype=torch.int64)) == 60 + 16


def test_flashinfer_host_args(bf):
    rows = _rows(bf, [(6, 100, 1.0), (1, 1000, 0.1), (1, 37, 1.0)])
    meta = PagedKVMeta.build(rows.q_lens, rows.page_lists, rows.kv_lens, 16)
    h = bf.flashinfer_host_args(meta)
    assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in h.values())
    assert h["kv_lens"].tolist() == rows.kv_lens
    assert h["qo_indptr"].tolist() == [0, 6, 7, 8]
    assert h["kv_indptr"].tolist() == [0, 7, 14, 17]
    assert h["last_page_len"].tolist() == [4, 8, 5]


def test_sampling_inputs(bf):
    a = bf.parse_args(["--vocab", "300", "--sample-batch", "5", "--gamma", "3", "--top-k", "8"])
    s = bf.sampling_inputs(a, torch.Generator().manual_seed(0), "cpu")
    assert s.logits.shape == (5, 300) and s.drafts.shape == (5, 3)
    assert s.target_probs.shape == (20, 300) and s.draft_probs.shape == (15, 300)
    for probs in (s.target_probs, s.draft_probs):
        torch.testing.assert_close(probs.sum(-1), torch.ones(len(probs)))
        assert ((probs > 0).sum(-1) <= 8).all()  # top-k 8
    # each draft was drawn from its own filtered distribution
    assert (s.draft_probs[torch.arange(15), s.drafts.reshape(-1)] > 0).all()
    assert [r.logit_row for r in s.rows] == [0, 4, 8, 12, 16]
    assert [r.drafts for r in s.rows] == s.drafts.tolist()
    # the draw's logits are p_0's: filtering them gives the rows' first target distribution
    p0 = bf.probs_from_logits(s.logits, s.temperature, s.top_k, s.top_p, True, True)
    torch.testing.assert_close(p0, s.target_probs[::4])
    for accepted, tokens in verify_sampled_batch(s.target_probs, s.rows, s.draft_probs):
        assert 0 <= accepted <= 3 and len(tokens) == accepted + 1


def test_case_rows_summary_and_table(bf, tmp_path):
    times = iter([4.0, 8.0, 2.0])
    case = bf.Case("decode", "B1 ctx1k", nbytes=2_000_000_000, copy_gbps=1000.0,
                   timer=lambda fn: next(times))  # fmt: skip
    check = lambda out: ("max abs diff", out)
    case.add("ours", lambda: 0.0, check)
    case.add("fi decode", lambda: 1e-3, check)
    case.add("fi broken", lambda: 1 / 0, check)
    case.add("fi prefill", lambda: 2e-3, check)
    ours, slow, broken, fast = case.entries
    assert (ours["gbps"], ours["pct_copy"], ours["ours_over_it"]) == (500.0, 0.5, 1.0)
    assert (slow["gbps"], slow["ours_over_it"], slow["check_value"]) == (250.0, 2.0, 1e-3)
    assert broken["error"].startswith("ZeroDivisionError")
    assert fast["ours_over_it"] == 0.5
    (s,) = bf.summary(case.entries)
    assert (s["best"], s["ours_over_best"]) == ("fi prefill", 0.5)
    with pytest.raises(ZeroDivisionError):  # ours must run
        bf.Case("decode", "x", 1, 1.0, timer=lambda fn: 1.0).add("ours", lambda: 1 / 0, check)

    result = dict(device="H200", flashinfer="0.6.18", copy_gbps=1000.0, entries=case.entries,
                  summary=bf.summary(case.entries))  # fmt: skip
    table = bf.markdown(result)
    assert "| decode | B1 ctx1k | fi decode | 8.000 | 250 | 25% | 2.00x | max abs diff 0.001 |" in (
        table
    )
    assert "| decode | B1 ctx1k | fi broken | error: ZeroDivisionError" in table
    assert "| decode | B1 ctx1k | fi prefill | 0.50x |" in table
    bf.write_json(tmp_path / "r.json", result)
    assert json.loads((tmp_path / "r.json").read_text()) == result


def test_parse_args_rejects_unknown_parts(bf):
    assert bf.parse_args(["--parts", "decode,sampling"]).parts == "decode,sampling"
    with pytest.raises(SystemExit):
        bf.parse_args(["--parts", "decode,prefill"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a GPU")
def test_exits_clearly_without_cuda(tmp_path):
    out = tmp_path / "r.json"
    run = subprocess.run([sys.executable, str(SCRIPTS / "bench_flashinfer.py"), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 1
    assert "needs a CUDA GPU" in run.stderr
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer")
def test_small_run_on_gpu(bf, tmp_path):
    out = tmp_path / "r.json"
    bf.main(["--out", str(out), "--batches", "4", "--contexts", "2048", "--vocab", "4096",
             "--sample-batch", "8", "--reps", "3"])  # fmt: skip
    r = json.loads(out.read_text())
    ran = [e for e in r["entries"] if "ms" in e]
    for part in ("decode", "verify", "mixed"):
        fi = [e for e in ran if e["part"] == part and e["kernel"] != "ours"]
        assert fi, f"no flashinfer kernel ran the {part} rows"
        assert max(e["check_value"] for e in fi) < 2e-2  # bf16 outputs agree with ours
    draws = [e for e in ran if e["part"] == "sampling draw"]
    assert len(draws) == 4 and all(e["check_value"] == 1.0 for e in draws)
    assert {s["part"] for s in r["summary"]} >= {"decode", "verify", "mixed", "sampling accept"}
