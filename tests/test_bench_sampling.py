"""scripts/bench_sampling.py: one small run on a CUDA GPU (skipped elsewhere): the filter keeps
the reference's tokens (the script asserts it), the race draws the reference's
tokens, and the JSON holds a row per row count and filter; its choices case on the CPU too."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import scripts_imported


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_small_run_on_gpu(tmp_path):
    out, baseline = tmp_path / "r.json", tmp_path / "old_filter.py"
    # an "older filter": the torch reference, loaded from its own file as an old kernels file is
    baseline.write_text("from aspire_ray.worker.sampler import probs_from_logits_ref as "
                        "filter_probs  # noqa: F401\n")  # fmt: skip
    old_race = tmp_path / "old_race.py"  # an "older race": the torch reference, likewise
    old_race.write_text("from aspire_ray.worker.sampler import race_ref as race_rows  # noqa\n")
    with scripts_imported("bench_sampling") as (bench,):
        bench.main(["--out", str(out), "--rows", "3,17", "--vocab", "5000", "--reps", "3",
                    "--ways", "8", "--full-passes", "1,4", "--accept-rows", "4",
                    "--baseline-filter", str(baseline),
                    "--baseline-race", str(old_race)])  # fmt: skip
    r = json.loads(out.read_text())
    assert [(x["rows"], x["filter"]) for x in r["results"]] == [
        (3, "top-k + top-p"), (3, "top-p"), (17, "top-k + top-p"), (17, "top-p")]
    for x in r["results"]:
        assert x["race_same_draws"] and x["filter_max_abs_diff"] < 1e-5
        assert set(x["filter_ways"]) == {"8x1", "8x4"} and x["filter_baseline_ms"] > 0
        assert x["race_baseline_ms"] > 0 and x["race_full_support_baseline_ms"] > 0
    assert r["accept"]["rows"] == 4 and 0 <= r["accept"]["mean_accepted"] <= 5
    assert r["choices"]["ms"] > 0 and r["choices"]["torch_ms"] > 0  # the same choices asserted


def test_the_choices_case_checks_both_ways():
    """The choices case on the test's device (the CPU's kernels under Triton's interpreter, which
    a GPU host does not set): it asserts the same choices and q store both ways; its times here
    mean nothing."""
    import argparse

    a = argparse.Namespace(accept_rows=9, gamma=3, verify_every=3, vocab=3000, top_k=20,
                           temperature=0.7, top_p=0.8)  # fmt: skip
    with scripts_imported("bench_sampling") as (bench,):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        r = bench.choices_case(a, lambda fn: (fn(), 0.0)[1], device)
    assert (r["rows"], r["queries"]) == (9, 3 * 4 + 6)
