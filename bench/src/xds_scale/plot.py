# SPDX-License-Identifier: Apache-2.0
"""Plots `cargo xtask bench xds-scale`: against the number of clients N, for each M (endpoints) and
each supervisor binary, the p99 from one worker change to each client's ACK (with the goal, 50 ms),
and the supervisor's memory per client (one connection with its streams; goal 100 KB per stream).
State-of-the-world cells with 100 endpoints per service only.

usage: plot.py CELLS_CSV OUT_SVG
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: a smaller file
matplotlib.rcParams["svg.hashsalt"] = "peregrine"  # the same data gives the same file
import matplotlib.pyplot as plt  # noqa: E402

STYLES = ["-", "--", ":", "-."]
COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red"]


def main():
    source, out = sys.argv[1:3]
    with open(source, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["kind"] == "sotw"
                and int(r["services"]) == max(1, int(r["endpoints"]) // 100)]
    labels = sorted({r["supervisor"] for r in rows})
    sizes = sorted({int(r["endpoints"]) for r in rows})
    fig, (ack, mem) = plt.subplots(1, 2, figsize=(11, 4.5))
    for li, label in enumerate(labels):
        for mi, m in enumerate(sizes):
            cells = sorted((int(r["clients"]), r) for r in rows
                           if r["supervisor"] == label and int(r["endpoints"]) == m)
            if not cells:
                continue
            n = [c for c, _ in cells]
            style = dict(color=COLORS[mi % len(COLORS)], linestyle=STYLES[li % len(STYLES)], marker="o")
            ack.plot(n, [max(float(r["ack_p99_ms"]), 0.1) for _, r in cells],
                     label=f"{label}, M={m}", **style)
            mem.plot(n, [max(float(r["rss_per_client_kib"]), 0.1) for _, r in cells],
                     label=f"{label}, M={m}", **style)
    ack.axhline(50, color="tab:red", linewidth=0.8, linestyle=":")
    ack.text(10, 52, "goal: p99 < 50 ms", color="tab:red", fontsize=8)
    mem.axhline(200 / 1.024, color="tab:red", linewidth=0.8, linestyle=":")
    mem.text(10, 200, "goal: 100 KB per stream (2 streams)", color="tab:red", fontsize=8)
    for ax in (ack, mem):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("clients N (each a CDS and an EDS stream)")
        ax.grid(True, which="both", linewidth=0.3)
        ax.legend(fontsize=7)
    ack.set_ylabel("one change: p99 to each client's ACK (ms)")
    mem.set_ylabel("supervisor RSS per client (KiB)")
    ack.set_title("Push latency")
    mem.set_title("Memory per connected client")
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None})


main()
