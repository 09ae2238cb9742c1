"""scripts/headline_table.py: issue 15's table and checks, computed from benchmark JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import SCRIPTS, scripts_imported

ROOT = SCRIPTS.parent


def _row(mode: str, tps: float, **kw) -> dict:
    return {"mode": mode, "tokens_per_s": tps, "context": "32000", "batch": 64,
            "device": "NVIDIA H200", "mean_accepted_length": 6.0, "acceptance_rate": 0.9,
            "gamma_mean": 7.0, "breakdown": {"step_seconds": {"round": 3.0, "verify": 1.0}},
            **kw}  # fmt: skip


def test_checks_are_ratios_of_the_tables_rows(tmp_path):
    report = {"args": {"model": "/m/qwen.gguf", "temperature": 0.0},
              "results": [_row("ar", 100.0), _row("magicdec/g8", 180.0),
                          _row("aspire_fixed/g8", 200.0), _row("aspire_fixed/g6", 210.0),
                          _row("aspire", 190.0), _row("aspire/q3", 230.0)]}  # fmt: skip
    path = tmp_path / "bd.json"
    path.write_text(json.dumps(report))
    with scripts_imported("headline_table") as (ht,):
        (table,) = ht.tables_of(str(path))
        checks = ht.checks(table)
        text = ht.markdown(table)
    # plain `aspire` against the fastest fixed mode of any gamma, magicdec, and ar; a variant
    # of aspire is a row, not the mode checked
    assert checks == pytest.approx({"aspire / best fixed (aspire_fixed/g6)": 190 / 210,
                                    "aspire / magicdec (magicdec/g8)": 190 / 180,
                                    "aspire / ar": 1.9})  # fmt: skip
    assert "qwen.gguf, context 32000, batch 64, greedy, NVIDIA H200" in table.title
    assert "| aspire_fixed/g6 | 210 | 2.10 | 6.00 | 0.900 | 7.00 | round 75%, verify 25% |" in text
    assert not table.predicted


def test_without_ar_no_ratio_to_it(tmp_path):
    report = {"args": {"model": "m", "temperature": 0.7, "top_p": 0.9},
              "results": [_row("aspire_fixed/g8", 200.0), _row("aspire", 150.0)]}
    path = tmp_path / "bd.json"
    path.write_text(json.dumps(report))
    with scripts_imported("headline_table") as (ht,):
        (table,) = ht.tables_of(str(path))
        assert ht.checks(table) == {"aspire / best fixed (aspire_fixed/g8)": 0.75}
        assert "| aspire | 150 |  |" in ht.markdown(table)
    assert "T 0.7, top-p 0.9" in table.title


def test_session_38s_h200_figures():
    # docs/benchmarks.md §8.50's ratios, from their JSON: the five-domain mix (aspire 0.933x
    # aspire_fixed/g8, 0.945x magicdec/g8) and the 32k runs (1.99x ar, 0.958x; sampled 0.739x)
    out = subprocess.run(
        [sys.executable, str(SCRIPTS / "headline_table.py"),
         str(ROOT / "docs/bench_decode_h200_qwen05b_mix5_s38.json"),
         str(ROOT / "docs/bench_diag_h200_qwen05b_32k_s38_greedy.json"),
         str(ROOT / "docs/bench_diag_h200_qwen05b_32k_t07p09_s38.json"),
         "--sweep", str(ROOT / "docs/simulate_h200_qwen05b_mix5_s38_oracle.json"),
         "--json", "/dev/stdout", "--out", "/dev/null"],
        capture_output=True, text=True, check=True).stdout  # fmt: skip
    got = [(t["predicted"], {k: round(v, 3) for k, v in t["checks"].items()})
           for t in json.loads(out)]  # fmt: skip
    assert got == [
        (False, {"aspire / best fixed (aspire_fixed/g8)": 0.933,
                 "aspire / magicdec (magicdec/g8)": 0.945, "aspire / ar": 1.552}),
        (False, {"aspire / best fixed (aspire_fixed/g8)": 0.958, "aspire / ar": 1.986}),
        (False, {"aspire / best fixed (aspire_fixed/g8)": 0.739}),
        (True, {"aspire / best fixed (aspire_fixed/g8)": 0.984,
                "aspire / magicdec (magicdec/g8)": 1.0}),
    ]  # fmt: skip
