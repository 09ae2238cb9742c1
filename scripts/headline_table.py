"""Issue 15's headline table from benchmark JSON: every mode of every run, and the issue's
checks, computed from the files (never typed in by hand).

    python scripts/headline_table.py docs/bench_decode_h200_qwen05b_mix5_s38.json \
        docs/bench_diag_h200_qwen05b_32k_s38_greedy.json \
        --sweep docs/simulate_h200_qwen05b_mix5_s38_fixed_sweep.json --out table.md

Inputs are ``bench_decode.py`` reports (a ``diag`` run's too): one table per (file, context
bucket), a row per mode with tokens/s, the ratio to ``ar`` (where the run has it: ratios are
only taken within a run), L (committed tokens per verification), the drafts' acceptance, the
mean draft length and where the decode window's worker time went by step kind. Under each
table the issue's checks, each a ratio of two rows of that table:

    aspire / best fixed   `aspire` against the fastest fixed-gamma mode of the run (magicdec,
                          specattn, aspire_fixed, any gamma or variant): issue 15 wants >= 1
    aspire / magicdec     against the fastest magicdec mode: >= 1.3 on the heterogeneous mix
    aspire / ar           >= 2.5 at 32k x 64 and >= 3.5 at the largest batch (Qwen 0.5B)

``--sweep`` adds ``simulate.py`` reports (a fixed-gamma sweep, an oracle) as tables of their own:
predictions, marked so, never mixed into a measured table's ratios.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

FIXED = ("magicdec", "specattn", "aspire_fixed")  # modes of one shared draft length


@dataclass
class Table:
    title: str
    rows: list[dict]  # one per mode, in the run's order
    predicted: bool = False  # a simulator's report


def _spec(mode: str) -> str:
    return mode.partition("/")[0]


def tables_of(path: str) -> list[Table]:
    """A bench_decode (or simulate) report -> one Table per context bucket."""
    with open(path) as f:
        report = json.load(f)
    args = report.get("args", {})
    predicted = "traces" in args  # simulate.py's reports name their traces
    # a simulation's context is its traces' (meta), or the projection's prompt length
    default = report.get("meta", {}).get("context") or args.get("prompt_len") or "?"
    by_context: dict[str, list[dict]] = {}
    for row in report["results"]:
        by_context.setdefault(str(row.get("context") or default), []).append(row)
    tables = []
    for context, rows in by_context.items():
        model = os.path.basename(str(args.get("model") or report.get("meta", {}).get("model")
                                     or args.get("traces") or "?"))
        temperature = args.get("temperature", 0.0) or 0.0
        sampling = "greedy" if not temperature else f"T {temperature}, top-p {args.get('top_p')}"
        batch = rows[0].get("batch", args.get("batch"))
        device = rows[0].get("device", "simulated" if predicted else "?")
        kind = "simulated" if predicted else device
        title = (f"{model}, context {context}, batch {batch}, {sampling}, {kind} "
                 f"(`{os.path.basename(path)}`)")
        tables.append(Table(title, rows, predicted))
    return tables


def _label(row: dict) -> str:
    """A row's mode, with its gamma where a sweep names it apart from the mode."""
    gamma = row.get("gamma")
    mode = row["mode"]
    return f"{mode}/g{gamma}" if gamma and "/g" not in mode and _spec(mode) in FIXED else mode


def _fastest(rows: list[dict], specs: tuple[str, ...]) -> dict | None:
    rows = [r for r in rows if _spec(r["mode"]) in specs and "+oracle" not in r["mode"]]
    return max(rows, key=lambda r: r["tokens_per_s"], default=None)


def checks(table: Table) -> dict[str, float]:
    """The issue's ratios for `aspire` (the plain mode) in this table, those it has rows for."""
    rows = table.rows
    aspire = next((r for r in rows if r["mode"] == "aspire"), None)
    if aspire is None:
        return {}
    out = {}
    for name, specs in (("best fixed", FIXED), ("magicdec", ("magicdec",))):
        other = _fastest(rows, specs)
        if other is not None:
            ratio = aspire["tokens_per_s"] / other["tokens_per_s"]
            out[f"aspire / {name} ({_label(other)})"] = ratio
    ar = next((r for r in rows if r["mode"] == "ar"), None)
    if ar is not None:
        out["aspire / ar"] = aspire["tokens_per_s"] / ar["tokens_per_s"]
    return out


def _steps(row: dict) -> str:
    """Where the window's worker seconds went, by step kind (bench_decode's breakdown)."""
    seconds = row.get("breakdown", {}).get("step_seconds", {})
    total = sum(seconds.values())
    if not total:
        return ""
    return ", ".join(f"{k} {v / total:.0%}" for k, v in seconds.items() if v)


def _num(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def markdown(table: Table) -> str:
    ar = next((r for r in table.rows if r["mode"] == "ar"), None)
    head = ("| mode | tok/s | vs `ar` | L | acceptance | mean draft length | worker time by "
            "step kind |\n|---|---|---|---|---|---|---|")
    lines = [f"**{table.title}**" + (" (predicted)" if table.predicted else ""), "", head]
    for r in table.rows:
        versus = r["tokens_per_s"] / ar["tokens_per_s"] if ar else None
        lines.append(f"| {_label(r)} | {r['tokens_per_s']:,.0f} | {_num(versus, '.2f')} | "
                     f"{_num(r.get('mean_accepted_length'), '.2f')} | "
                     f"{_num(r.get('acceptance_rate'), '.3f')} | "
                     f"{'' if r['mode'] == 'ar' else _num(r.get('gamma_mean'), '.2f')} | "
                     f"{_steps(r)} |")
    found = checks(table)
    if found:
        lines += ["", "; ".join(f"{k}: **{v:.3f}**" for k, v in found.items())]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", help="bench_decode.py JSON reports")
    p.add_argument("--sweep", action="append", default=[],
                   help="simulate.py reports (predicted tables), repeatable")
    p.add_argument("--out", default=None, help="markdown file (default: print)")
    p.add_argument("--json", default=None, help="the checks as JSON, per table")
    args = p.parse_args()
    tables = [t for path in args.reports + args.sweep for t in tables_of(path)]
    text = "\n\n".join(markdown(t) for t in tables) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text, end="")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"table": t.title, "predicted": t.predicted, "checks": checks(t)}
                       for t in tables], f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
