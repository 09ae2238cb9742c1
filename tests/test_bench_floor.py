"""scripts/bench_floor.py: its byte arithmetic against hand computations, and one end-to-end
CPU run on a tiny random model (two modes, valid JSON out)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import one_thread_env, scripts_imported
from transformers import AutoConfig

from aspire_ray.config import SpecConfig
from aspire_ray.model.arch import ModelArch
from aspire_ray.worker.model_loading import hf_weight_shapes

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
_spec = importlib.util.spec_from_file_location("floor_report", SCRIPTS / "floor_report.py")
fr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fr)


def _arch(tied: bool) -> ModelArch:
    cfg = AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, head_dim=16,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               vocab_size=256, tie_word_embeddings=tied)  # fmt: skip
    return ModelArch.from_hf_config(cfg)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_weight_bytes_by_hand(tied):
    # per layer: q, o 64x64; k, v 32x64; q/k/v biases 64+32+32; gate, up, down 128x64; 2 norms
    layer = 2 * 4096 + 2 * 2048 + 128 + 3 * 8192 + 2 * 64
    # 4 layers, final norm, the head (a tied head is the table), 5 gathered embedding rows
    params = 4 * layer + 64 + 256 * 64 + 5 * 64
    assert params == 165248
    assert fr.weight_bytes(hf_weight_shapes(_arch(tied)), n_tokens=5, elem=2) == 2 * params


def test_kv_page_reads_by_hand():
    def budget(p):
        return max(4, math.ceil(0.07 * p))

    rows = [
        fr.Row("draft", 1000, 1),  # 63 pages, k = max(4, ceil(4.41)) = 5
        fr.Row("verify", 306, 6, num_drafts=5),  # 20 pages, every layer
        fr.Row("draft", 40, 1),  # 3 pages <= k: the sparse list is the full list
    ]
    # refresh layer full for draft rows: 3 layers x 5 + 63; 4 x 20; 3 x 3 + 3
    assert fr.kv_page_reads(rows, 4, 16, budget, refresh_full=True) == 78 + 80 + 12
    assert fr.kv_page_reads(rows, 4, 16, budget, refresh_full=False) == 20 + 80 + 12
    assert fr.page_bytes(16, kv_heads=2, head_dim=16, elem=2) == 2048


def test_paper_shape_kv_bytes():
    # Qwen2.5-Coder-0.5B at 32,000 tokens: 2,000 pages of 8 KiB per layer; k = 140 pages
    spec = SpecConfig(mode="aspire_fixed")
    page = fr.page_bytes(16, kv_heads=2, head_dim=64, elem=2)
    ar = fr.kv_page_reads([fr.Row("verify", 32000, 1)] * 64, 24, 16, spec.sparse_budget, True)
    assert ar * page == 64 * 24 * 2000 * 8192  # 25.2 GB, the `ar` step of issue 14
    draft = fr.kv_page_reads([fr.Row("draft", 32000, 1)], 24, 16, spec.sparse_budget, True)
    assert draft == 23 * 140 + 2000


def test_step_kind_and_idle():
    v0, v5, d = fr.Row("verify", 9, 1), fr.Row("verify", 9, 6, 5), fr.Row("draft", 9, 1)
    assert [fr.step_kind(r) for r in ([v0, v0], [v0, v5], [d], [d, v5])] == [
        "ar", "verify", "draft", "mixed"]  # fmt: skip
    assert fr.busy_seconds([(0, 2), (1, 3), (5, 6)], 0.5, 5.5) == 3.0
    assert fr.idle_per_step([0, 4], 8, [(1, 3), (3.5, 5), (6, 7)]) == [(4, 2.5), (4, 2)]
    # gaps in [0, 20): 0-1 (1), 3-3.5 (0.5), 5-12 (7), 13-20 (7, to the window's end)
    gaps = fr.idle_gaps([(1, 3), (2, 3), (3.5, 5), (12, 13)], 0, 20, buckets=(0.5, 2, 7))
    assert gaps == [(1, 0.5), (1, 1.0), (2, 14.0), (0, 0.0)]


def test_host_at_long_gaps_charges_the_innermost_span():
    # GPU busy [0, 10) and [200, 300): one long gap [10, 200) (the 100 us limit scaled to 50)
    gaps = fr.long_gaps([(0, 10), (200, 300), (300, 320)], 0, 400, longer_than=50)
    assert gaps == [(10, 200), (320, 400)]
    spans = [(0, 1000, "step"), (0, 60, "schedule"), (50, 120, "sync"), (300, 350, "launch")]
    host = fr.host_at_gaps(gaps, spans, every_ns=10)
    # [10, 50): schedule (4 points); [50, 120): sync, which began later (7); [120, 200) and
    # [350, 400): only the step (13); [320, 350): launch (3)
    assert host == {"step": 130, "sync": 70, "schedule": 40, "launch": 30}
    assert fr.host_at_gaps(gaps, [], every_ns=10) == {"(none)": 270}
    kernels = [(0, 10, "plan"), (200, 300, "attn"), (300, 320, "accept")]
    assert fr.gap_borders(gaps, kernels) == {("plan", "attn"): 1, ("accept", "-"): 1}


class _Event:  # a profiler event as torch 2.11 gives it: no is_python_function
    def __init__(self, name, start, end, device="CPU", thread=1):
        self._name, self._span, self._thread = name, (start, end), thread
        self._device = getattr(torch.autograd.DeviceType, device)

    def name(self):
        return self._name

    def start_ns(self):
        return self._span[0]

    def end_ns(self):
        return self._span[1]

    def device_type(self):
        return self._device

    def start_thread_id(self):
        return self._thread


def test_gap_hosts_names_the_host_function_of_an_idle_gap(capsys):
    with scripts_imported("bench_floor") as (bf,):
        events = [_Event(bf.STEP_LABEL, 0, 1_000_000),
                  _Event("aspire_ray/engine/scheduler.py(129): schedule", 100_000, 700_000),
                  _Event("cudaEventSynchronize", 20_000, 90_000),
                  _Event("aten::add", 100_000, 700_000),  # an op: not a host span here
                  _Event("aspire_ray/x.py(1): elsewhere", 0, 1_000_000, thread=2)]  # fmt: skip
        # the GPU busy [0, 10 us) and [800 us, 1 ms): idle [10, 800) us, one plan of 4 steps
        bf.gap_hosts(events, [(0, 10_000, "plan"), (800_000, 1_000_000, "attn")],
                     [0, 1_000_000], steps=4)
    err = capsys.readouterr().err
    assert "1 gaps, 0.198 ms per decode step" in err
    assert "   0.150  aspire_ray/engine/scheduler.py(129): schedule" in err  # 600 us / 4
    assert "   0.018  cudaEventSynchronize" in err and "elsewhere" not in err
    assert "    1  plan -> attn" in err  # the kernels on either side of the gap


def test_summarize():
    step = {"kind": "ar", "rows": 2, "tokens": 2, "worker_s": {"forward": 0.002},
            "bytes": {"weights": 1000, "kv": 3000, "total": 4000}}  # fmt: skip
    steps = [dict(step, wall_s=w) for w in (0.004, 0.006, 0.005)]
    prof = [{"kind": "ar", "window_s": 0.007, "busy_s": 0.003}]
    k = fr.summarize(steps, prof, bandwidth=1e6)["ar"]
    assert k["wall_ms"] == pytest.approx(5.0) and k["floor_ms"] == pytest.approx(4.0)
    assert k["ratio"] == pytest.approx(1.25) and k["worker_ms"]["forward"] == pytest.approx(2.0)
    assert k["gpu"]["idle_ms"] == pytest.approx(2.0) and k["gpu"]["idle_frac"] == pytest.approx(0.4)
    gaps = [{"count": c, "ms": c * 1e-3} for c in (300, 2, 0, 1)]
    k2 = fr.summarize(steps, [dict(prof[0], idle_gaps=gaps)], bandwidth=1e6)["ar"]
    assert [g["upto_us"] for g in k2["gpu"]["idle_gaps"]] == [2.0, 10.0, 100.0, None]
    assert k2["gpu"]["idle_gaps"][0]["count"] == 300 and "idle_gaps" not in k["gpu"]
    assert "| ar | ar | 3 | 5.00 |" in fr.table([{"mode": "ar", "kinds": {"ar": k}}],
                                                 {"bytes_per_s": 1e6, "counts": "", "copy_bytes": 1,
                                                  "repeats": 1})  # fmt: skip


def test_graph_kinds_against_the_step_floors():
    # the graph clock's draft steps (as they ran in their rounds) against the floor of the
    # mode's own "draft" step kind; `ar`'s chain graphs ("decode") against its "ar" kind; a
    # kind with no step kind of that name (the warm-up's pieces) has no floor
    draft, ar = {"floor_ms": 1.0}, {"floor_ms": 8.0}
    results = [{"mode": "aspire_fixed/g8", "kinds": {"draft": draft},
                "graph_kinds": {"draft": {"replays": 72, "median_ms": 2.5, "mean_ms": 3.0},
                                "piece": {"replays": 3, "median_ms": 9.0}}},
               {"mode": "ar", "kinds": {"ar": ar},
                "graph_kinds": {"decode": {"replays": 40, "median_ms": 9.2}}}]  # fmt: skip
    text = fr.graph_kinds_table(results)
    assert "| aspire_fixed/g8 | draft | 72 | 2.500 | 3.000 | 1.000 | 2.50x | 3.00x |" in text
    assert "| aspire_fixed/g8 | piece | 3 | 9.000 | 9.000 | - | - | - |" in text
    assert "| ar | decode | 40 | 9.200 | 9.200 | 8.000 | 1.15x | 1.15x |" in text


def test_graph_kinds_of_rounds_take_the_slope_floors():
    # rounds of 3 and 7 drafts: a draft step's floor is the slope's (1.0 ms), the verification's
    # its round's floor less its drafts' (9 - 3 = 6 ms; 13 - 7 = 6 ms)
    def rnd(floor, draft_ms, verify_ms):
        return {"kinds": {"round": {"wall_ms": 2 * floor, "floor_ms": floor}},
                "graph_kinds": {"draft": {"replays": 10, "median_ms": draft_ms},
                                "verify": {"replays": 2, "median_ms": verify_ms}}}

    results = [{"mode": "magicdec/g3", **rnd(9.0, 2.4, 6.6)},
               {"mode": "magicdec/g7", **rnd(13.0, 2.5, 7.2)}]
    # the mode's own "draft" steps (a plan's few alone, of fewer rows) do not price the graphs
    results[1]["kinds"]["draft"] = {"floor_ms": 0.9}
    text = fr.graph_kinds_table(results)
    assert "| magicdec/g3 | draft | 10 | 2.400 | 2.400 | 1.000 | 2.40x | 2.40x |" in text
    assert "| magicdec/g3 | verify | 2 | 6.600 | 6.600 | 6.000 | 1.10x | 1.10x |" in text
    assert "| magicdec/g7 | verify | 2 | 7.200 | 7.200 | 6.000 | 1.20x | 1.20x |" in text
    assert "| magicdec/g7 | draft | 10 | 2.500 | 2.500 | 1.000 | 2.50x | 2.50x |" in text


def test_graph_kinds_of_a_lone_step_kind_take_its_kv_at_the_batch():
    # a round mode at one gamma: its own draft steps ran on 32 rows (near the requests' ends);
    # the round's draft graph replays 64, so its floor is the weights once and twice the KV:
    # 1 GB + 2 x 0.5 GB over the step's 1.5 GB in 1.5 ms (1 GB/ms) = 2.0 ms
    draft = {"rows": 32.0, "floor_ms": 1.5,
             "bytes": {"weights": 1e9, "kv": 0.5e9, "total": 1.5e9}}  # fmt: skip
    results = [{"mode": "magicdec/g8", "kinds": {"draft": draft},
                "graph_kinds": {"draft": {"replays": 10, "median_ms": 4.0}}}]  # fmt: skip
    text = fr.graph_kinds_table(results, batch=64)
    row = "| magicdec/g8 | draft | 10 | 4.000 | 4.000 | 2.000 (32 rows to 64) | 2.00x | 2.00x |"
    assert row in text
    # a step kind of the whole batch (or no batch given) keeps its own floor
    assert "| 1.500 | 2.67x |" in fr.graph_kinds_table(results)
    draft["rows"] = 64.0
    assert "| 1.500 | 2.67x |" in fr.graph_kinds_table(results, batch=64)


def test_runs_joined_at_one_gamma_have_no_slope():
    # a greedy and a sampled run of magicdec/g8 joined (floor_report.py A.json B.json): the
    # same gamma twice is no slope (it divided by zero), and the graph kinds still price
    def run(wall):
        return {"mode": "magicdec/g8",
                "kinds": {"round": {"wall_ms": wall, "floor_ms": 10.0},
                          "draft": {"rows": 64.0, "floor_ms": 1.0}},
                "graph_kinds": {"draft": {"replays": 8, "median_ms": 2.0}}}  # fmt: skip

    results = [run(20.0), run(24.0)]
    assert fr.draft_slopes(results) == []
    assert fr.graph_kinds_table(results, 64).count("| 1.000 | 2.00x | 2.00x |") == 2


@pytest.mark.timeout(120)
def test_script_runs_on_cpu(tmp_path):
    out = tmp_path / "floor.json"
    cmd = [sys.executable, str(SCRIPTS / "bench_floor.py"), "--device", "cpu", "--dtype",
           "float32", "--dummy-shapes", "tiny-qwen3", "--context", "200", "--batch", "2",
           "--modes", "ar,aspire_fixed/noround,aspire", "--steps", "6", "--warmup", "2",
           "--copy-mib", "8", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=one_thread_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| ar | ar |" in proc.stdout and "not measured on the CPU" in proc.stdout
    report = json.loads(out.read_text())
    assert "bench_floor.py" in report["command"] and report["gpu"] == "cpu"
    by_mode = {r["mode"]: r for r in report["results"]}
    # noround: draft steps of their own (rounds in one plan, the default, are one step kind)
    assert set(by_mode) == {"ar", "aspire_fixed/noround", "aspire"}
    assert "draft" in by_mode["aspire_fixed/noround"]["kinds"]
    # aspire's asynchronous runs: bytes of a step of the run (their mean, as the wall time is),
    # every step reads the weights
    runs = [s for s in by_mode["aspire"]["steps"] if s["kind"] == "async"]
    assert runs and all(s["rows"] <= 2 for s in runs)
    one_step = by_mode["ar"]["steps"][0]["bytes"]["weights"]
    for s in runs:
        assert s["chain"] > 1 and one_step <= s["bytes"]["weights"] < 2 * one_step
    bw = report["bandwidth"]["bytes_per_s"]
    page = fr.page_bytes(16, kv_heads=2, head_dim=32, elem=4)  # tiny-qwen3, fp32
    for r in report["results"]:
        for s in r["steps"]:
            whole = s["bytes"]["kv"] * (s["chain"] if s["kind"] == "async" else 1)
            assert round(whole) % page == 0 and s["bytes"]["kv"] > 0
        for k in r["kinds"].values():
            assert k["ratio"] == pytest.approx(k["wall_ms"] / (1e3 * k["bytes"]["total"] / bw))
    # an `ar` row at >= 201 tokens reads all of its >= 13 pages in all 4 layers
    assert by_mode["ar"]["kinds"]["ar"]["bytes"]["kv"] >= 2 * 4 * 13 * page


def test_an_asynchronous_run_is_counted_step_by_step():
    # a row holding 1 draft at gamma 2 over 5 steps: draft, verify 2, draft, draft, verify 2
    from aspire_ray.plan import async_kinds

    kinds = async_kinds(held=1, gamma=2, steps=5)
    assert kinds == [-1, 2, -1, -1, 2]
    rows = fr.async_run_rows(1000, kinds)
    assert [(r.kind, r.context_len, r.num_tokens, r.run_step) for r in rows] == [
        ("draft", 1000, 1, 0), ("verify", 1001, 3, 1), ("draft", 1002, 1, 2),
        ("draft", 1003, 1, 3), ("verify", 1004, 3, 4)]  # fmt: skip
    assert fr.step_kind(rows) == "async"

    def budget(p):
        return max(4, math.ceil(0.07 * p))

    # each step read on its own: three draft steps (63 pages, k = 5) and two verify steps
    plain = [r._replace(run_step=-1) for r in rows]
    by_step = sum(fr.kv_page_reads([r], 4, 16, budget, refresh_full=True) for r in plain)
    assert by_step == 3 * (3 * 5 + 63) + 2 * 4 * 63


def test_draft_step_is_the_slope_between_two_gammas():
    # two rounds of one mode, 3 and 7 drafts: the 4 more draft steps are all that differs
    def rnd(wall, floor, busy):
        return {"kinds": {"round": {"wall_ms": wall, "floor_ms": floor, "gpu": {"busy_ms": busy}}}}

    results = [
        {"mode": "ar", "kinds": {"ar": {"wall_ms": 8.0}}},
        {"mode": "aspire_fixed/g3", **rnd(15.0, 9.0, 14.0)},
        {"mode": "aspire_fixed/g7", **rnd(23.0, 13.0, 22.0)},
        {"mode": "magicdec/g5+serial", **rnd(20.0, 10.0, 19.0)},  # one gamma: no slope
        {"mode": "magicdec/g2+serial", **rnd(14.0, 8.5, 13.0)},
        {"mode": "magicdec/g4", **rnd(1.0, 1.0, 1.0)},  # another base: alone, no slope
    ]
    slopes = {s["mode"]: s for s in fr.draft_slopes(results)}
    assert set(slopes) == {"aspire_fixed", "magicdec/serial"}
    a = slopes["aspire_fixed"]
    assert a["gammas"] == [3, 7] and a["wall_ms"] == pytest.approx(2.0)
    assert a["floor_ms"] == pytest.approx(1.0) and a["ratio"] == pytest.approx(2.0)
    assert a["busy_ratio"] == pytest.approx(2.0) and a["c"] == pytest.approx(0.25)
    # the verification of 4 queries a row: round(3) - 3 draft steps
    assert a["verify_queries"] == 4 and a["verify_ms"] == pytest.approx(9.0)
    assert a["verify_floor_ms"] == pytest.approx(6.0) and a["verify_ratio"] == pytest.approx(1.5)
    assert a["verify_vs_ar"] == pytest.approx(9.0 / 8.0)
    assert slopes["magicdec/serial"]["wall_ms"] == pytest.approx(2.0)
    assert slopes["magicdec/serial"]["verify_ms"] == pytest.approx(10.0)
    assert "| aspire_fixed | 3, 7 | 2.00 | 1.000 | 2.00x | 2.00 (2.00x) | 0.25 | 9.00 (4) " \
        "| 6.000 | 1.50x | 1.12x |" in fr.slopes_table(fr.draft_slopes(results))


def test_graph_ratios_against_the_ar_graph():
    # c and verify / ar from the graph clock's medians; the verification's queries from gN;
    # modes without both graph kinds (ar itself, aspire's async runs) are left out
    results = [
        {"mode": "ar", "graph_kinds": {"decode": {"median_ms": 8.0}}},
        {"mode": "magicdec/g5", "graph_kinds": {"draft": {"median_ms": 2.0},
                                                "verify": {"median_ms": 9.2}}},
        {"mode": "aspire/q4", "graph_kinds": {"async": {"median_ms": 3.0}}},
    ]  # fmt: skip
    (g,) = fr.graph_ratios(results)
    assert g["mode"] == "magicdec/g5" and g["queries"] == 6
    assert g["c"] == pytest.approx(0.25) and g["verify_vs_ar"] == pytest.approx(1.15)
    assert "| magicdec/g5 | 8.000 | 2.000 | 0.250 | 9.200 (6) | 1.150x |" in fr.ratios_table([g])
    assert fr.graph_ratios(results[1:]) == []  # no `ar` on the clock


def test_sampling_params_from_the_options():
    # --temperature / --top-p / --top-k: every request sampled (seeded), greedy by default
    import argparse

    args = argparse.Namespace(warmup=2, steps=6, profile_steps=0, cprofile=0, temperature=0.7,
                              top_p=0.9, top_k=20, modes="ar,magicdec")  # fmt: skip
    with scripts_imported("bench_floor") as (bf,):
        sampled = bf.sampling_params(args)
        greedy = bf.sampling_params(argparse.Namespace(**{**vars(args), "temperature": 0.0}))
    assert (sampled.temperature, sampled.top_p, sampled.top_k) == (0.7, 0.9, 20)
    assert sampled.seed == 0 and sampled.ignore_eos and greedy.temperature == 0.0
    assert sampled.max_tokens == greedy.max_tokens == bf.new_tokens(args)
    # requests outlast the run at the largest draft length of its modes, every draft accepted:
    # 8 plans of 4 rounds of gamma + 1 tokens, and a verification of d_max
    assert bf.new_tokens(args) == 8 * 4 * 6 + 16 + 2
    wide = argparse.Namespace(**{**vars(args), "modes": "ar,magicdec/g3,aspire_fixed/g7+d32"})
    assert bf.new_tokens(wide) == 8 * 4 * 8 + 32 + 2


def test_the_gpu_scripts_mode_lists_parse():
    """Every quoted --modes list of scripts/gpu_runs.sh names modes bench_decode knows, so that a
    device call (minutes of a scarce budget) does not die at its first mode on a typo."""
    text = (SCRIPTS / "gpu_runs.sh").read_text()
    lists = re.findall(r'--modes "([^"$]+)"', text)
    assert len(lists) >= 2  # floor-shapes' two; the others take $modes
    with scripts_imported("bench_decode") as (bench,):
        from aspire_ray.config import MODES

        for modes in lists:
            for mode in modes.split(","):
                spec_mode, _ = bench.mode_options(mode)
                assert spec_mode in MODES, mode
        with pytest.raises(SystemExit, match="unknown mode variant"):
            bench.mode_options("ar/pdll")
