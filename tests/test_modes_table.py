"""One table of speculation modes (issue 19; DESIGN.md §1.6): ``config.MODES`` says what each
mode means, every other module reads its row instead of comparing mode names."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

import aspire_ray
from aspire_ray.config import (
    MODES,
    SPEC_MODES,
    EngineConfig,
    ModeSpec,
    SchedulerConfig,
    SpecConfig,
)
from aspire_ray.worker.page_policies import PAGE_POLICIES, make_selector

# mode -> (page_policy, refresh_while_drafting, synchronized, gamma_rule), DESIGN.md §1.6
ROWS = {
    "ar": ("none", False, False, "none"),
    "magicdec": ("window", False, True, "fixed"),
    "specattn": ("topk", False, True, "fixed"),
    "aspire_fixed": ("topk", True, True, "fixed"),
    "aspire_fsm": ("topk", True, False, "fsm"),
    "aspire": ("topk", True, False, "cost_model"),
}


def test_spec_modes_come_from_the_table():
    assert SPEC_MODES == tuple(MODES) == tuple(ROWS)


@pytest.mark.parametrize("mode", list(ROWS))
def test_mode_row(mode):
    policy, refresh, synchronized, gamma_rule = ROWS[mode]
    row = MODES[mode]
    assert (row.page_policy, row.refresh_while_drafting, row.synchronized, row.gamma_rule) \
        == ROWS[mode]  # fmt: skip
    cfg = SpecConfig(mode=mode)
    assert cfg.mode_spec is row
    assert cfg.speculative == (mode != "ar")
    assert cfg.synchronized == synchronized
    assert cfg.refresh_while_drafting == refresh
    assert row.reads_cost_model == (gamma_rule == "cost_model") == (mode == "aspire")
    # the maximum drafts: d_max for every drafting mode (the scheduler's cap), 0 for ar
    assert cfg.max_drafts == (0 if mode == "ar" else cfg.d_max)
    odd = SpecConfig(mode=mode, gamma=20, fsm_max=30, d_max=8)
    assert odd.max_drafts == (0 if mode == "ar" else 8)
    # the page policy: the registry's class, none without drafts
    selector = make_selector(cfg)
    if policy == "none":
        assert selector is None
    else:
        assert type(selector) is PAGE_POLICIES[policy]
        assert selector.uses_scores == (policy == "topk")


def test_every_page_policy_is_registered():
    assert {row.page_policy for row in MODES.values()} - {"none"} <= set(PAGE_POLICIES)


@pytest.mark.parametrize("bad", [
    dict(page_policy="none"),
    dict(gamma_rule="none"),
    dict(page_policy="none", gamma_rule="none", refresh_while_drafting=True, synchronized=False),
    dict(page_policy="none", gamma_rule="none"),
    dict(gamma_rule="bogus"),
    dict(extra=None),
], ids=["drafts-without-pages", "pages-without-drafts", "refresh-without-drafts",
        "synchronized-without-drafts", "unknown-gamma-rule", "unknown-field"])  # fmt: skip
def test_inconsistent_rows_are_refused(bad):
    row = dict(page_policy="topk", refresh_while_drafting=False, synchronized=True,
               gamma_rule="fixed") | bad
    with pytest.raises((ValueError, TypeError)):
        ModeSpec(**row)


@pytest.mark.parametrize(("row", "match"), [
    (ModeSpec("bogus", False, True, "fixed"), "page_policy must be one of"),
    (ModeSpec("window", True, True, "fixed"), "reads no scores"),
], ids=["unknown-policy", "refresh-without-scores"])  # fmt: skip
def test_make_selector_refuses_rows_its_registry_cannot_serve(monkeypatch, row, match):
    monkeypatch.setitem(MODES, "new_mode", row)
    with pytest.raises(ValueError, match=match):
        make_selector(SpecConfig(mode="new_mode"))


def test_max_drafts_bounds_the_verify_row():
    for mode in SPEC_MODES:
        EngineConfig(spec=SpecConfig(mode=mode))  # the default budget holds d_max + 1
    with pytest.raises(ValueError, match="d_max"):
        EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=32),
                     spec=SpecConfig(mode="aspire", d_max=40))  # fmt: skip


# (P, k_i) at k_min = 32, rho = 0.07, float64 as on the host: 0.07 * 10,000 = 700.0000000000001
BUDGETS = [(0, 32), (1, 32), (457, 32), (458, 33), (459, 33), (10_000, 701), (123_457, 8642)]


@pytest.mark.parametrize(("pages", "k"), BUDGETS, ids=[str(p) for p, _ in BUDGETS])
def test_sparse_budget_one_formula(pages, k):
    """k_i = max(k_min, ceil(rho * P)): the scalar (driver), numpy (host) and torch (device)
    forms and the page policies agree exactly."""
    cfg = SpecConfig(mode="aspire")
    assert cfg.sparse_budget(pages) == k
    host = cfg.sparse_budgets(np.array([pages], dtype=np.int64))
    device = cfg.sparse_budgets(torch.tensor([pages], dtype=torch.int64))
    assert host.dtype == np.int64 and device.dtype == torch.int64
    assert int(host[0]) == int(device[0]) == k
    for mode in ("magicdec", "aspire"):
        selector = make_selector(SpecConfig(mode=mode))
        assert selector.budget(pages) == k
        assert int(selector.budgets(np.array([pages], dtype=np.int64))[0]) == k
        assert int(selector.budgets(torch.tensor([pages]))[0]) == k


# `x.mode == "ar"`, `mode in ("magicdec", ...)`, `spec_mode != 'aspire'` and the reverse order
_COMPARE = re.compile(
    r"\w*mode\s*(?:==|!=|\bnot\s+in\b|\bin\b)\s*(\([^)]*\)|\[[^\]]*\]|\{[^}]*\}|\"[^\"]*\"|'[^']*')"
    r"|(\"[^\"]*\"|'[^']*')\s*(?:==|!=|\bin\b)\s*[\w.]*mode\b")
_LITERAL = re.compile(r"\"([^\"]*)\"|'([^']*)'")


def mode_name_comparisons(root: Path) -> list[str]:
    """'path:line: text' of every comparison of a mode to a literal mode name under root,
    config.py excepted (the one place that names modes)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).as_posix() == "config.py":
            continue
        text = path.read_text()
        for m in _COMPARE.finditer(text):
            names = {a or b for a, b in _LITERAL.findall(m.group(0))}
            if names & set(MODES):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{path.relative_to(root)}:{line}: {m.group(0)}")
    return found


def test_no_module_compares_mode_names():
    assert mode_name_comparisons(Path(aspire_ray.__file__).parent) == []


def test_the_comparison_scan_catches_each_form(tmp_path):
    (tmp_path / "a.py").write_text(
        'if cfg.mode == "ar":\n'
        "    pass\n"
        'if mode in ("magicdec", "specattn"):\n'
        "    pass\n"
        "ok = spec_mode != 'aspire'\n"
        'ok = "aspire_fsm" == self.cfg.mode\n'
        'if mode == "off" or mode in ("auto", "force"):\n'  # calibrate's mode: no spec mode
        "    pass\n")
    (tmp_path / "config.py").write_text('speculative = mode != "ar"\n')
    assert [f.split(":")[1] for f in mode_name_comparisons(tmp_path)] == ["1", "3", "5", "6"]


def test_the_refresh_while_drafting_can_be_switched_against_the_row():
    # SpecConfig.draft_refresh: None keeps the row's; a top-k mode may turn it off or on; a
    # mode whose drafts read no scores (magicdec's window, ar) cannot turn it on
    assert SpecConfig(mode="aspire").refresh_while_drafting
    assert not SpecConfig(mode="aspire", draft_refresh=False).refresh_while_drafting
    assert SpecConfig(mode="specattn", draft_refresh=True).refresh_while_drafting
    assert not SpecConfig(mode="magicdec", draft_refresh=False).refresh_while_drafting
    for mode in ("magicdec", "ar"):
        with pytest.raises(ValueError, match="draft_refresh needs a mode whose drafts read"):
            SpecConfig(mode=mode, draft_refresh=True)
    with pytest.raises(ValueError, match="draft_refresh must be None, True or False"):
        SpecConfig(mode="aspire", draft_refresh="no")
