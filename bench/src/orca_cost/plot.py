# SPDX-License-Identifier: Apache-2.0
"""Plots `cargo xtask bench orca-cost`: the supervisor's CPU (share of one core) and resident memory
against the number of ORCA out-of-band streams it serves, idle and with the streams, one point per
round.

usage: plot.py ORCA_COST_CSV OUT_SVG
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: a smaller file
matplotlib.rcParams["svg.hashsalt"] = "peregrine"  # the same data gives the same file
import matplotlib.pyplot as plt  # noqa: E402


def main():
    source, out = sys.argv[1:3]
    with open(source, newline="") as f:
        rows = list(csv.DictReader(f))
    streams = [int(r["streams"]) for r in rows]
    fig, (cpu, rss) = plt.subplots(1, 2, figsize=(10, 4))
    cpu.plot(streams, [100 * float(r["idle_cpu_cores"]) for r in rows], "o", color="0.5",
             label="before the streams (same supervisor)")
    loaded = [100 * float(r["loaded_cpu_cores"]) for r in rows]
    low = [l - 100 * float(r["loaded_cpu_min"]) for l, r in zip(loaded, rows)]
    high = [100 * float(r["loaded_cpu_max"]) - l for l, r in zip(loaded, rows)]
    cpu.errorbar(streams, loaded, yerr=[low, high], fmt="o-", color="tab:blue", capsize=3,
                 label="with the streams (median, slice range)")
    cpu.set_xlabel("ORCA streams (simulated Envoys x workers)")
    cpu.set_ylabel("supervisor CPU (% of one core)")
    cpu.grid(True, linewidth=0.3)
    cpu.legend(fontsize=8)
    cpu.set_title("CPU at 5 reports/s per stream", fontsize=10)
    mib = 1024 * 1024
    rss.plot(streams, [int(r["idle_rss_bytes"]) / mib for r in rows], "o", color="0.5",
             label="before the streams")
    rss.plot(streams, [int(r["loaded_rss_bytes"]) / mib for r in rows], "o-", color="tab:orange",
             label="with the streams")
    rss.set_xlabel("ORCA streams (simulated Envoys x workers)")
    rss.set_ylabel("supervisor RSS (MiB)")
    rss.grid(True, linewidth=0.3)
    rss.legend(fontsize=8)
    rss.set_title("Resident memory", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None})


main()
