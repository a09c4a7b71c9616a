#!/usr/bin/env python3
"""herald's benchmark report (scripts/bench runs it; see README "Performance").

  report.py merge --parts DIR --out DIR --mode quick|full [--runs FILE] [--commit FILE]
                  [--skipped BENCH]... [--plot]
      Reads DIR/<bench>.json of every benchmark, checks that every expected figure is
      there as a positive finite number, writes OUT/bench.json (every figure, with the run's
      machine, commit and load), OUT/bench.md (the table) and, with --plot, OUT/bench.png
      (isolation curve and throughput bars; needs matplotlib, benches/requirements.txt).
      Prints the table.
  report.py check FILE
      Checks a merged bench.json the same way.

Exits 1 when a benchmark is broken (its figures missing, not numbers, zero, negative or
not finite); a target that is not met never fails it: the table says so.
Standard library only, except matplotlib for --plot.
"""

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys

# Every figure scripts/bench expects, by benchmark. Names are the same in both modes; the
# sizes are in each figure's label and in the benchmark's params.
EXPECTED = {
    "purge": ["purge.time"],
    "delivery_throughput": [
        "throughput.drain",
        "throughput.publish",
        "throughput.end_to_end",
        "throughput.forwarder",
        "throughput.end_to_end_vs_forwarder",
        "throughput.end_to_end_ceiling",
        "throughput.end_to_end_store_bound",
        "throughput.end_to_end_sync_bound",
        "throughput.end_to_end_paced_sync_bound",
        "wait.end_to_end.round_trip",
        "wait.end_to_end.in_store",
        "wait.sync_at_writer_pace",
        "latency.idle.p50",
        "latency.idle.p99",
        "latency.idle_forwarder.p50",
        "latency.idle_forwarder.p99",
        "latency.half_load.p50",
        "latency.half_load.p99",
        "latency.spaced_quiet.p50",
        "latency.spaced_quiet.p99",
        "latency.spaced_after_burst.p50",
        "latency.spaced_after_burst.p99",
        "cpu.end_to_end.herald",
        "cpu.end_to_end.generator",
        "cpu.end_to_end.forwarder",
        "cpu.end_to_end.herald_budget",
    ],
    "isolation": [
        f"isolation.held_{held}.{q}" for held in (0, 100, 1000, 10000) for q in ("p50", "p99")
    ],
    "memory": [
        "memory.standalone.rss",
        "memory.standalone.hwm",
        "startup.standalone",
        "memory.pending.rss",
        "memory.pending.hwm",
        "throughput.backlog_drain",
    ],
    "operator": [
        "publish.cluster_auth",
        "memory.cluster.rss",
        "memory.cluster.hwm",
        "memory.cluster.per_subscription",
        "memory.cluster.projected_100k",
        "reconcile.cluster",
        "startup.cluster",
    ],
    "scale_out": [
        "scale_out.postgres_1",
        "scale_out.postgres_3",
        "scale_out.cpu_3",
        *(
            f"scale_out.postgres_{n}.{what}"
            for n in (1, 3)
            for what in ("server_cpu", "herald_cpu", "statements", "wal")
        ),
        "scale_out.ceiling_per_server_core",
        "scale_out.ceiling_per_server_core_3",
        "scale_out.drain_postgres",
        "scale_out.drain_postgres.unpause",
        "scale_out.drain_postgres.ceiling",
        "scale_out.postgres_3.ceiling",
        *(f"scale_out.drain_postgres.{what}" for what in ("server_cpu", "statements", "wal")),
        *(
            f"scale_out.{phase}.busy_cores"
            for phase in ("embedded", "postgres_1", "postgres_3", "drain_postgres", "river")
        ),
    ],
}
BENCHES = list(EXPECTED)


def positive(value):
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def problems(figures, benches):
    """What is wrong with `figures` (a list of figure objects) for `benches`."""
    found = []
    by_name = {}
    for f in figures:
        name = f.get("name")
        if name in by_name:
            found.append(f"figure {name} appears twice")
        by_name[name] = f
    for bench in benches:
        for name in EXPECTED[bench]:
            f = by_name.get(name)
            if f is None:
                found.append(f"{bench}: figure {name} is missing")
                continue
            if not positive(f.get("value")):
                found.append(f"{bench}: figure {name} is {f.get('value')!r}, not a positive finite number")
            if f.get("reference") is not None:
                if not positive(f["reference"]):
                    found.append(f"{bench}: reference of {name} is {f['reference']!r}")
                elif not positive(f.get("ratio")):
                    found.append(f"{bench}: ratio of {name} is {f.get('ratio')!r}")
            if not f.get("unit") or not f.get("label"):
                found.append(f"{bench}: figure {name} has no unit or label")
            if f.get("met") not in (True, False, None):
                found.append(f"{bench}: figure {name} has met={f.get('met')!r}")
    return found


def fmt(value):
    if value is None:
        return "—"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def table(report):
    lines = [
        "| figure | value | reference (same run) | ratio | target | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for f in report["figures"]:
        unit = f["unit"]
        reference = (
            f"{fmt(f['reference'])} {unit}: {f['reference_name']}" if f["reference"] is not None else "—"
        )
        ratio = fmt(f["ratio"]) if f["ratio"] is not None else "—"
        met = {True: "yes", False: "**no**", None: "—"}[f["met"]]
        lines.append(
            f"| {f['label']} | {fmt(f['value'])} {unit} | {reference} | {ratio} | {f['target'] or '—'} | {met} |"
        )
    return "\n".join(lines)


def header(report):
    m = report["machine"]
    loads = ", ".join(
        f"{r['bench']} {r['loadavg_before']} → {r['loadavg_after']}" for r in report["runs"]
    )
    skipped = f" Skipped: {', '.join(report['skipped'])}." if report["skipped"] else ""
    return (
        f"herald benchmarks, {report['mode']} mode, {report['date']}, commit {report['commit']}; "
        f"{m['cpus']} CPUs ({m['cpu']}), {m['system']}; {report['rustc']}.\n"
        f"Load average (1, 5, 15 min) before → after each benchmark: {loads}.{skipped}\n"
        f"Every ratio is value / reference, both measured in the same run; "
        f"`met` is judged against the target, which never fails the run."
    )


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def command(*args):
    try:
        return subprocess.run(args, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def read_commit(path):
    """The commit the benchmarks were built from (scripts/bench notes it before building),
    else the checkout's now."""
    if path and os.path.exists(path):
        with open(path) as f:
            return f.read().strip()
    commit = command("git", "rev-parse", "--short", "HEAD")
    if command("git", "status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    return commit


def read_runs(path):
    runs = []
    if path and os.path.exists(path):
        with open(path) as f:
            for line in f:
                bench, seconds, before, after = line.rstrip("\n").split("\t")
                runs.append(
                    {"bench": bench, "seconds": float(seconds), "loadavg_before": before, "loadavg_after": after}
                )
    return runs


def merge(args):
    benches = [b for b in BENCHES if b not in args.skipped]
    figures, params, broken = [], {}, []
    for bench in benches:
        path = os.path.join(args.parts, f"{bench}.json")
        try:
            with open(path) as f:
                part = json.load(f)
        except (OSError, ValueError) as e:
            broken.append(f"{bench}: no figures ({path}: {e})")
            continue
        if part.get("mode") != args.mode:
            broken.append(f"{bench}: ran in {part.get('mode')!r} mode, not {args.mode}")
        params[bench] = part.get("params", {})
        order = ["name", "label", "value", "unit", "reference", "reference_name", "ratio", "target", "met"]
        for f in part.get("figures", []):
            figures.append({"bench": bench, **{k: f.get(k) for k in order}})
    commit = read_commit(args.commit)
    report = {
        "mode": args.mode,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "rustc": command("rustc", "--version"),
        "machine": {"cpus": os.cpu_count(), "cpu": cpu_model(), "system": platform.platform()},
        "runs": read_runs(args.runs),
        "skipped": args.skipped,
        "params": params,
        "figures": figures,
    }
    broken += problems(figures, benches)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
        f.write("\n")
    text = f"{header(report)}\n\n{table(report)}\n"
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(text)
    print()
    print(text)
    if args.plot and not broken:
        plot(report, os.path.join(args.out, "bench.png"))
    print(f"written: {args.out}/bench.json, bench.md{', bench.png' if args.plot and not broken else ''}")
    return fail(broken)


def fail(broken):
    if broken:
        print("\nBROKEN BENCHMARKS:", file=sys.stderr)
        for line in broken:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


def check(args):
    with open(args.file) as f:
        report = json.load(f)
    skipped = report.get("skipped", [])
    unknown = [b for b in skipped if b not in EXPECTED]
    broken = [f"unknown skipped benchmark {b}" for b in unknown]
    broken += problems(report.get("figures", []), [b for b in BENCHES if b not in skipped])
    if not broken:
        count = len(report["figures"])
        print(f"{args.file}: all {count} figures present and finite" + (f" (skipped: {', '.join(skipped)})" if skipped else ""))
    return fail(broken)


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    figures = {f["name"]: f for f in report["figures"]}
    fig, (iso, thr) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})

    held = (0, 100, 1000, 10000)
    wire = report["params"].get("isolation", {})
    x = range(len(held))
    for q, style in (("p50", "o-"), ("p99", "s-")):
        iso.plot(x, [figures[f"isolation.held_{h}.{q}"]["value"] for h in held], style, label=f"healthy {q}")
    p99_none = figures["isolation.held_0.p99"]["value"]
    iso.axhline(1.5 * p99_none, color="tab:orange", linestyle=":", label="target at 1,000: 1.5 × p99 with none held")
    iso.axhline(50, color="tab:red", linestyle="--", label="target at 10,000: p99 < 50 ms")
    iso.set_xticks(list(x))
    iso.set_xticklabels(
        [f"{h:,}\n({wire[f'on_the_wire_held_{h}']:,} on the wire)" if h else "0" for h in held]
    )
    iso.set_xlabel("receivers that never answer")
    iso.set_ylabel("publish → arrival, ms (log scale)")
    iso.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    iso.yaxis.set_major_formatter(plain)
    iso.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    lowest = min(figures[f"isolation.held_{h}.p50"]["value"] for h in held)
    highest = max(50, *(figures[f"isolation.held_{h}.p99"]["value"] for h in held))
    bottom, top = lowest / 2, highest * 8
    iso.set_ylim(bottom, top)
    iso.set_yticks([t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000) if bottom <= t <= top])
    iso.set_title("Isolation: a healthy subscription's latency")
    iso.legend(fontsize=8, loc="upper left", ncol=2)

    bare = figures["throughput.end_to_end"]["reference"]
    bars = [
        ("bare reqwest\nPOST loop", bare, "tab:gray"),
        ("herald\ndrain", figures["throughput.drain"]["value"], "tab:blue"),
        ("herald durable\npublish", figures["throughput.publish"]["value"], "tab:blue"),
        ("herald\nend to end", figures["throughput.end_to_end"]["value"], "tab:green"),
        ("forwarder,\nno store", figures["throughput.forwarder"]["value"], "tab:orange"),
    ]
    positions = range(len(bars))
    thr.bar(positions, [b[1] for b in bars], color=[b[2] for b in bars])
    for i, (_, value, _) in enumerate(bars):
        thr.text(i, value, f"{value:,.0f}", ha="center", va="bottom", fontsize=8)
    thr.axhline(0.5 * bare, color="tab:red", linestyle="--", label="target: end to end ≥ 0.5 × bare loop")
    thr.set_xticks(list(positions))
    thr.set_xticklabels([b[0] for b in bars], fontsize=8)
    thr.set_ylabel("events (requests) per second")
    concurrency = report["params"].get("delivery_throughput", {}).get("concurrency", "?")
    thr.set_title(f"Throughput on loopback, {concurrency} concurrent")
    thr.legend(fontsize=8)

    loads = [r["loadavg_before"].split()[0] for r in report["runs"]]
    fig.suptitle(
        f"herald {report['mode']} benchmark, {report['date']}, commit {report['commit']}, "
        f"{report['machine']['cpus']} CPUs, 1-min load {min(loads, default='?')}–{max(loads, default='?')}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge")
    m.add_argument("--parts", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--mode", required=True, choices=["quick", "full"])
    m.add_argument("--runs")
    m.add_argument("--commit", help="file holding the commit the benchmarks were built from")
    m.add_argument("--skipped", action="append", default=[], choices=BENCHES)
    m.add_argument("--plot", action="store_true")
    c = sub.add_parser("check")
    c.add_argument("file")
    args = parser.parse_args()
    return merge(args) if args.command == "merge" else check(args)


if __name__ == "__main__":
    sys.exit(main())
