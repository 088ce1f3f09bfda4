"""The docs' table of `benchmarks.models`, rendered from its JSON output (never typed by hand).

    python -m benchmarks.models --json=benchmarks/results/models_cpu.json   # measure
    python -m benchmarks.models_table benchmarks/results/models_cpu.json    # rewrite the docs' table
    python -m benchmarks.models_table --print FILE.json                      # print another run's tables

The tables sit in docs/performance.md between the BEGIN/END markers below; tests/test_docs.py
checks that they are the rendering of the committed JSON. The at-scale prediction's links and its
all-reduce model (AT_SCALE_LINKS, allreduce_seconds) live here too.
"""

from __future__ import annotations

import argparse
import json
import os

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "performance.md")
BEGIN = "<!-- BEGIN models table: python -m benchmarks.models_table FILE.json -->"
END = "<!-- END models table -->"
AT_SCALE_BEGIN = "<!-- BEGIN at-scale table: python -m benchmarks.models_table FILE.json -->"
AT_SCALE_END = "<!-- END at-scale table -->"
NAMES = {"language_model": "language model"}

# Links of the "At scale" prediction: (name, GPUs per host, hosts, intra-host all-reduce bus
# bandwidth in bytes/s, per-hop latency inside a host in s, per-host network bandwidth in bytes/s,
# per-hop latency between hosts in s).
AT_SCALE_LINKS = (
    ("8 GPUs, 1 host (NVLink, 200 GB/s)", 8, 1, 200e9, 5e-6, None, None),
    ("4 hosts x 8 GPUs (100 Gb/s per host)", 8, 4, 200e9, 5e-6, 12.5e9, 20e-6),
    ("4 hosts x 8 GPUs (8 x 200 Gb/s per host)", 8, 4, 200e9, 5e-6, 200e9, 20e-6),
)


def allreduce_seconds(size_bytes: float, gpus: int, hosts: int, intra_bw, intra_latency, host_bw, host_latency):
    """Ring (per host) + ring (across hosts) all-reduce, the alpha-beta model:
    t = 2 (g - 1) (a_in + S / (g B_in)) + 2 (h - 1) (a_net + S / (h B_net))
    with S the gradient bytes, g GPUs per host, h hosts, B_in the intra-host bus bandwidth, B_net the
    host's network bandwidth (the 8 GPUs' inter-host rings share it), a the per-hop latencies."""
    seconds = 2 * (gpus - 1) * (intra_latency + size_bytes / (gpus * intra_bw))
    if hosts > 1:
        seconds += 2 * (hosts - 1) * (host_latency + size_bytes / (hosts * host_bw))
    return seconds


def rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def ratio(summary: dict) -> str:
    """ "0.93 (0.90-0.95)": the median of the per-round ratios and their lowest and highest."""
    if summary["low"] == summary["high"]:
        return f"{summary['median']:.2f}"
    return f"{summary['median']:.2f} ({summary['low']:.2f}-{summary['high']:.2f})"


def engine_table(report: dict) -> str:
    """The markdown table of every model's examples/s (medians over the rounds) and paired ratios."""
    rows = [
        "| model | batch | bare step | + input | engine loop, no input | engine (steps / loop) | engine, pipeline "
        "| engine, guarded "
        "| fit spe=1 | fit best (spe) | loop / bare | engine / bare | pipeline / bare | engine / fit best "
        "| pipeline / fit best |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        m, q = r["medians"], r["ratios"]
        rows.append(
            f"| `{NAMES.get(r['model'], r['model'])}` | {r['batch']} | {rate(m['bare'])} | {rate(m['fed'])} "
            f"| {rate(m['engine loop'])} | {rate(m['engine'])} ({r['steps_per_loop']}) "
            f"| {rate(m['engine pipeline'])} "
            f"| {rate(m['engine guarded'])} | {rate(m['fit default'])} | {rate(m['fit best'])} ({r['best_spe']}) "
            f"| {ratio(q['loop / bare'])} | {ratio(q['engine / bare'])} | {ratio(q['pipeline / bare'])} "
            f"| {ratio(q['engine / fit best'])} | {ratio(q['pipeline / fit best'])} |"
        )
    rounds = len(report["results"][0]["rounds"]) if report["results"] else 0
    return (
        "\n".join(rows)
        + (
            f"\n\n{report['device']}; {report.get('versions', '')}; {rounds} interleaved "
            f"round(s); examples/s are medians, ratios the median (lowest-highest) of the "
            f"rounds' paired ratios."
        )
        + in_turn_line(report)
        + "\n\n"
        + targets_line(report)
    )


# The targets a run is judged by (issue 26): engine / bare at least BARE_TARGET, or
# BARE_TARGET_SLOW where the bare step takes over SLOW_STEP_SECONDS; engine / fit best at least FIT_TARGET.
BARE_TARGET, BARE_TARGET_SLOW, SLOW_STEP_SECONDS, FIT_TARGET = 0.90, 0.95, 0.005, 1.0


def missed_targets(report: dict, bare: str = "engine / bare") -> list:
    """[(model, ratio name, its summary, the target)] of every target the run's medians miss;
    `bare`: the ratio judged against the bare step (e.g. "engine / bare in turn")."""
    missed = []
    for r in report["results"]:
        slow = r["batch"] / r["medians"]["bare"] > SLOW_STEP_SECONDS
        for key, target in ((bare, BARE_TARGET_SLOW if slow else BARE_TARGET), ("engine / fit best", FIT_TARGET)):
            if key in r["ratios"] and r["ratios"][key]["median"] < target:
                missed.append((r["model"], key, r["ratios"][key], target))
    return missed


def targets_line(report: dict) -> str:
    """The run's verdict on the targets, by the medians of its paired ratios; against the bare step
    on batches in turn too, for runs that measured it."""

    def verdict(bare: str) -> str:
        missed = missed_targets(report, bare)
        if not missed:
            return f"met on all {len(report['results'])} models"
        # three decimals: a median of 0.996 misses 1.0 though it prints as 1.00 in the table
        return "missed: " + "; ".join(
            f"`{NAMES.get(model, model)}` {key} {summary['median']:.3f} "
            f"({summary['low']:.2f}-{summary['high']:.2f}; target {target:.2f})"
            for model, key, summary, target in missed
        )

    line = (
        f"Targets (engine / bare >= {BARE_TARGET:.2f}, >= {BARE_TARGET_SLOW:.2f} where the bare step takes over "
        f"{SLOW_STEP_SECONDS * 1e3:.0f} ms; engine / fit best >= {FIT_TARGET:.1f}; medians of the rounds): "
        + verdict("engine / bare")
        + "."
    )
    if any("engine / bare in turn" in r["ratios"] for r in report["results"]):
        line += " Judged against the bare step on batches in turn instead: " + verdict("engine / bare in turn") + "."
    return line


def in_turn_line(report: dict) -> str:
    """Engine / the bare step on batches taken in turn from memory (the ceiling of training on
    data), for the runs that measured it (from 2026-12-07 on); "" for earlier ones."""
    measured = [r for r in report["results"] if "engine / bare in turn" in r["ratios"]]
    if not measured:
        return ""
    return (
        "\n\nengine / bare step on batches in turn (64 batches held in memory, the next each step: "
        "nothing gathered or piped, but not the batch the cache just held): "
        + ", ".join(
            f"`{NAMES.get(r['model'], r['model'])}` {ratio(r['ratios']['engine / bare in turn'])}" for r in measured
        )
        + "."
    )


def flops_table(report: dict) -> str:
    """Parameters, FLOPs, achieved FLOP/s against the matmul peak, and the peak RSS of run.py."""
    peak = report["peak"]
    rows = [
        f"| model | parameters | MFLOP / example | engine GFLOP/s | of the matmul peak ({peak / 1e9:,.0f} GFLOP/s) "
        "| bare step, of the peak | peak RSS of `run.py` |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        achieved, bare = (r["medians"][key] * r["flops_per_example"] for key in ("engine", "bare"))
        rows.append(
            f"| `{NAMES.get(r['model'], r['model'])}` | {r['parameters']:,} | {r['flops_per_example'] / 1e6:,.2f} "
            f"| {achieved / 1e9:,.1f} | {achieved / peak:.0%} | {bare / peak:.0%} "
            f"| {r['peak_rss'] / 2**20:,.0f} MiB |"
        )
    return "\n".join(rows)


def at_scale_table(report: dict) -> str:
    """Each model's gradient bytes, its step time measured by the engine here, and the predicted
    efficiency t_step / (t_step + t_allreduce) on each of AT_SCALE_LINKS, with the step time at
    which the all-reduce takes 10 % (9 x t_allreduce)."""
    short = ("8 GPUs, 1 host", "4 x 8, 100 Gb/s", "4 x 8, 8 x 200 Gb/s")
    rows = [
        "| model | MB all-reduced / step | step here (whole batch) | "
        + " | ".join(short)
        + " | step needed for 90 % ("
        + " / ".join(short)
        + ") |",
        "|---|---|---|" + "---|" * len(short) + "---|",
    ]
    for r in report["results"]:
        step = r["batch"] / r["medians"]["engine"]
        allreduce = [allreduce_seconds(r["gradient_bytes"], *link[1:]) for link in AT_SCALE_LINKS]
        rows.append(
            f"| `{NAMES.get(r['model'], r['model'])}` | {r['gradient_bytes'] / 1e6:.2f} | {step * 1e3:.1f} ms | "
            + " | ".join(f"{step / (step + t):.1%}" for t in allreduce)
            + " | "
            + " / ".join(f"{9 * t * 1e3:.2f}" for t in allreduce)
            + " ms |"
        )
    return "\n".join(rows)


def tables(report: dict) -> str:
    """The docs' models block: both tables."""
    return engine_table(report) + "\n\n" + flops_table(report)


def replace_block(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    if begin not in text or end not in text:
        raise SystemExit(f"{DOC}: the markers {begin!r} and {end!r} are missing")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{block}\n{end}{tail}"


def rendered(text: str, report: dict) -> str:
    """The page with both generated blocks rewritten from `report`."""
    text = replace_block(text, tables(report))
    return replace_block(text, at_scale_table(report), AT_SCALE_BEGIN, AT_SCALE_END)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json_file", help="the output of python -m benchmarks.models --json=FILE")
    parser.add_argument(
        "--print",
        action="store_true",
        help="print the file's tables instead of rewriting docs/performance.md's (e.g. another host's run)",
    )
    args = parser.parse_args()
    with open(args.json_file) as f:
        report = json.load(f)
    if args.print:
        print(tables(report) + "\n\n" + at_scale_table(report))
        return
    with open(DOC) as f:
        text = f.read()
    with open(DOC, "w") as f:
        f.write(rendered(text, report))
    print(f"{DOC}: the models and at-scale tables rewritten from {args.json_file}")


if __name__ == "__main__":
    main()
