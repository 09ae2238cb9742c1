"""Turn the benchmark JSON in docs/ into PNG plots (docs/plots/).

    python scripts/plot_benchmarks.py --decode docs/bench_decode_h200.json \
        --acceptance docs/acceptance_cpu.json --cost docs/bench_cost_h200_8b.json --out docs/plots
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _grouped_bars(ax, groups: list[str], series: dict[str, list[float]]) -> None:
    """One bar per series in each group, side by side; groups labelled on the x axis."""
    width = 0.8 / len(series)
    for i, (name, ys) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(groups))], ys, width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(groups))], groups,
                  fontsize=7 if len(groups) > 4 else None)


def plot_speedup(report: dict, out: Path) -> Path:
    rows = report["results"]
    contexts = sorted(dict.fromkeys(r["context"] for r in rows),
                      key=lambda c: int(c) if c.isdigit() else -1)
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4))
    _grouped_bars(ax, contexts, {
        mode: [next((r["speedup_vs_ar"] or 0 for r in rows  # None: no ar in the run
                     if r["mode"] == mode and r["context"] == c), 0) for c in contexts]
        for mode in modes})
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("context bucket (tokens)")
    ax.set_ylabel("decode tokens/s over ar")
    ax.set_title(f"Decode speedup per mode (batch {rows[0].get('batch')}, "
                 f"{rows[0].get('device')})")
    ax.legend(fontsize=8, ncol=len(modes), loc="upper center", bbox_to_anchor=(0.5, -0.15))
    return _save(fig, out / "speedup.png")


def plot_breakdown(report: dict, out: Path) -> Path:
    rows = report["results"]
    labels = [f"{r['mode']}\n{r['context']}" for r in rows]
    kinds = sorted({k for r in rows for k in r["breakdown"]["step_seconds"]})
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.7), 4))
    bottom = [0.0] * len(rows)
    for kind in kinds:
        ys = [r["breakdown"]["step_seconds"].get(kind, 0.0) / max(r["tokens"], 1) * 1e3
              for r in rows]
        ax.bar(range(len(rows)), ys, bottom=bottom, label=kind)
        bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
    sched = [r["breakdown"]["timings"].get("schedule", 0) / max(r["tokens"], 1) * 1e3
             for r in rows]
    ax.bar(range(len(rows)), sched, bottom=bottom, label="scheduling (driver)")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("ms per committed token")
    ax.set_title("Where decode time goes, by step kind")
    ax.legend(fontsize=7)
    return _save(fig, out / "breakdown.png")


def plot_acceptance(report: dict, out: Path) -> list[Path]:
    fig, ax = plt.subplots(figsize=(7, 4))
    names = {"magicdec": "magicdec (sink + window)", "specattn": "specattn (no refresh)",
             "aspire_fixed": "aspire_fixed (refresh, l_r = N-2)"}
    for r in report["modes"]:
        ys = r["acceptance_by_position"]
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=names.get(r["mode"], r["mode"]))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Acceptance by draft position ({report['model']}, ctx {report['context']})")
    ax.legend(fontsize=8)
    p1 = _save(fig, out / "acceptance_by_position.png")
    n = report["num_layers"]
    default = next(r for r in report["modes"] if r["mode"] == "aspire_fixed")
    points = [(n - 2, default["acceptance_rate"])] + [
        (r["refresh_layer"], r["acceptance_rate"]) for r in report["refresh_layer_sweep"]]
    points.sort()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
    ax.set_xlabel(f"refresh layer l_r (of {n})")
    ax.set_ylabel(f"acceptance rate (gamma = {report['gamma']})")
    ax.set_title("Refresh-layer sweep")
    p2 = _save(fig, out / "refresh_layer_sweep.png")
    return [p1, p2]


def plot_decode_acceptance(report: dict, out: Path) -> Path:
    """Acceptance by draft position per mode at the largest context bucket of a decode run:
    specattn (top-k chosen at verification only) vs aspire_fixed (refreshed) on the same text."""
    rows = report["results"]
    ctx = max((r["context"] for r in rows), key=lambda c: int(c) if c.isdigit() else 0)
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        ys = r["acceptance_by_position"]
        if r["context"] != ctx or not ys:
            continue
        n = min(len(ys), 12)
        ax.plot(range(1, n + 1), ys[:n], marker="o", label=r["mode"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Acceptance by draft position, ctx {ctx}, batch {rows[0].get('batch')} "
                 f"({rows[0].get('device')})")
    ax.legend(fontsize=8)
    return _save(fig, out / "acceptance_by_position_gpu.png")


def _kilo(tokens: int) -> str:
    """16384 -> '16k', 100000 -> '100k' (as the tables write them)."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else f"{tokens / 1000:.0f}k"


def plot_cost(report: dict, out: Path) -> Path:
    """Step times of ar, draft and verify steps per shape and context (scripts/bench_cost.py)."""
    rows = report["results"]
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['shape']}\n{_kilo(r['context'])} B={r['batch']}" for r in rows]
    _grouped_bars(ax, labels, {kind: [r[kind]["wall_ms"] for r in rows]
                               for kind in ("ar", "draft", "verify")})
    ax.set_ylabel("ms per step (wall)")
    ax.set_title(f"Step cost at paper shapes, random weights ({report.get('device')})")
    ax.legend(fontsize=8)
    return _save(fig, out / "step_costs.png")


def _run_report(spec: str) -> tuple[str, dict]:
    """LABEL=FILE[:CALL] -> (label, report): a bench_decode JSON, or call CALL's report of a
    docs JSON that keeps several (``{"calls": [{"command", "report"}]}``)."""
    label, _, path = spec.partition("=")
    path, _, call = path.partition(":")
    data = json.loads(Path(path).read_text())
    return label, data["calls"][int(call or 0)]["report"] if "calls" in data else data


def plot_runs(reports: list[tuple[str, dict]], out: Path, name: str) -> Path:
    """Decode tokens/s of every mode in each of several runs side by side (one group a run,
    labelled; a mode a run lacks draws no bar): runs of one session, each ratio within its
    own group."""
    modes = list(dict.fromkeys(r["mode"] for _, rep in reports for r in rep["results"]))
    fig, ax = plt.subplots(figsize=(8, 4))
    _grouped_bars(ax, [label for label, _ in reports], {
        mode: [next((r["tokens_per_s"] for r in rep["results"] if r["mode"] == mode), 0)
               for _, rep in reports] for mode in modes})
    first = reports[0][1]["results"][0]
    contexts = list(dict.fromkeys(str(r.get("context")) for _, rep in reports
                                  for r in rep["results"]))  # fmt: skip
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"Decode tokens/s per mode and run ({first.get('device')}, context "
                 f"{' / '.join(contexts)})")
    ax.legend(fontsize=8, ncol=len(modes), loc="upper center", bbox_to_anchor=(0.5, -0.15))
    return _save(fig, out / f"{name}.png")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--decode", default=None)
    p.add_argument("--acceptance", default=None)
    p.add_argument("--cost", default=None, help="scripts/bench_cost.py JSON")
    p.add_argument("--runs", nargs="*", default=[],
                   help="LABEL=FILE[:CALL] bench_decode reports (a docs JSON of calls: CALL's "
                        "report, from 0) drawn side by side as --runs-name")
    p.add_argument("--runs-name", default="runs")
    p.add_argument("--out", default="docs/plots")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    made = []
    if args.decode:
        report = json.loads(Path(args.decode).read_text())
        made += [plot_speedup(report, out), plot_breakdown(report, out),
                 plot_decode_acceptance(report, out)]
    if args.runs:
        made.append(plot_runs([_run_report(spec) for spec in args.runs], out, args.runs_name))
    if args.cost:
        made.append(plot_cost(json.loads(Path(args.cost).read_text()), out))
    if args.acceptance:
        made += plot_acceptance(json.loads(Path(args.acceptance).read_text()), out)
    for path in made:
        print(path)


if __name__ == "__main__":
    main()
