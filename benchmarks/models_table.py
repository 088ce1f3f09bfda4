"""The docs' table of `benchmarks.models`, rendered from its JSON output (never typed by hand).

    python -m benchmarks.models --json=benchmarks/results/models_cpu.json   # measure (~25 min, 2 cores)
    python -m benchmarks.models_table benchmarks/results/models_cpu.json    # rewrite the docs' table

The table sits in docs/performance.md between the BEGIN/END markers below; tests/test_docs.py
checks that it is the rendering of the committed JSON.
"""

from __future__ import annotations

import argparse
import json
import os

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "performance.md")
BEGIN = "<!-- BEGIN models table: python -m benchmarks.models_table FILE.json -->"
END = "<!-- END models table -->"
NAMES = {"language_model": "language model"}


def rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def ratio(summary: dict) -> str:
    """"0.93 (0.90-0.95)": the median of the per-round ratios and their lowest and highest."""
    if summary["low"] == summary["high"]:
        return f"{summary['median']:.2f}"
    return f"{summary['median']:.2f} ({summary['low']:.2f}-{summary['high']:.2f})"


def engine_table(report: dict) -> str:
    """The markdown table of every model's examples/s (medians over the rounds) and paired ratios."""
    rows = ["| model | batch | bare step | + input | engine | engine, pipeline | engine, guarded | fit spe=1 "
            "| fit best (spe) | engine / bare | pipeline / bare | engine / fit best | pipeline / fit best |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        m, q = r["medians"], r["ratios"]
        rows.append(f"| `{NAMES.get(r['model'], r['model'])}` | {r['batch']} | {rate(m['bare'])} | {rate(m['fed'])} "
                    f"| {rate(m['engine'])} | {rate(m['engine pipeline'])} | {rate(m['engine guarded'])} "
                    f"| {rate(m['fit default'])} | {rate(m['fit best'])} ({r['best_spe']}) "
                    f"| {ratio(q['engine / bare'])} | {ratio(q['pipeline / bare'])} "
                    f"| {ratio(q['engine / fit best'])} | {ratio(q['pipeline / fit best'])} |")
    rounds = len(report["results"][0]["rounds"]) if report["results"] else 0
    return "\n".join(rows) + (f"\n\n{report['device']}; {report.get('versions', '')}; {rounds} interleaved "
                              f"round(s); examples/s are medians, ratios the median (lowest-highest) of the "
                              f"rounds' paired ratios.")


def flops_table(report: dict) -> str:
    """Parameters, FLOPs, achieved FLOP/s against the matmul peak, and the peak RSS of run.py."""
    peak = report["peak"]
    rows = [f"| model | parameters | MFLOP / example | engine GFLOP/s | of the matmul peak ({peak / 1e9:,.0f} GFLOP/s) "
            "| bare step, of the peak | peak RSS of `run.py` |", "|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        achieved, bare = (r["medians"][key] * r["flops_per_example"] for key in ("engine", "bare"))
        rows.append(f"| `{NAMES.get(r['model'], r['model'])}` | {r['parameters']:,} | {r['flops_per_example'] / 1e6:,.2f} "
                    f"| {achieved / 1e9:,.1f} | {achieved / peak:.0%} | {bare / peak:.0%} "
                    f"| {r['peak_rss'] / 2**20:,.0f} MiB |")
    return "\n".join(rows)


def tables(report: dict) -> str:
    """The docs' block: both tables."""
    return engine_table(report) + "\n\n" + flops_table(report)


def replace_block(text: str, block: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC}: the markers {BEGIN!r} and {END!r} are missing")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json_file", help="the output of python -m benchmarks.models --json=FILE")
    args = parser.parse_args()
    with open(args.json_file) as f:
        block = tables(json.load(f))
    with open(DOC) as f:
        text = f.read()
    with open(DOC, "w") as f:
        f.write(replace_block(text, block))
    print(f"{DOC}: the models table rewritten from {args.json_file}")


if __name__ == "__main__":
    main()
