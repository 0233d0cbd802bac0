# SPDX-License-Identifier: Apache-2.0
"""Plots `cargo xtask bench fleet`'s propagation latencies: the distribution (ECDF) over the changes
of each measure, from the change to its host's own Envoy, to every other host's registry, and to
every Envoy of the fleet, for exits and registrations, with the goal (p99 under 100 ms).

usage: plot.py PROPAGATION_CSV OUT_SVG
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: a smaller file
matplotlib.rcParams["svg.hashsalt"] = "peregrine"  # the same data gives the same file
import matplotlib.pyplot as plt  # noqa: E402

SERIES = [
    ("registration_own_ms", "registration -> its host's Envoy", "tab:green", "-"),
    ("registration_registries_ms", "registration -> every other registry (etcd)", "tab:orange", "-"),
    ("registration_everywhere_ms", "registration -> every Envoy", "tab:blue", "-"),
    ("exit_everywhere_ms", "exit (SIGKILL) -> every Envoy", "tab:purple", "--"),
]
GOAL_MS = 100.0


def main():
    source, out = sys.argv[1:3]
    with open(source, newline="") as f:
        rows = list(csv.DictReader(f))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for column, label, color, style in SERIES:
        values = sorted(max(float(r[column]), 0.01) for r in rows)
        n = len(values)
        ax.step(values, [(i + 1) / n for i in range(n)], where="post", color=color,
                linestyle=style, label=f"{label} (p50 {values[(n - 1) // 2]:.1f} ms, max {values[-1]:.1f} ms)")
    ax.axvline(GOAL_MS, color="tab:red", linewidth=0.8, linestyle=":")
    ax.axhline(0.99, color="0.5", linewidth=0.6, linestyle=":")
    ax.text(GOAL_MS, 0.55, "goal: p99 < 100 ms ", color="tab:red", fontsize=8, ha="right")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, log scale)")
    ax.set_ylabel(f"share of the {len(rows)} changes")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("A worker change on one of 3 hosts, until every Envoy of the fleet holds it")
    fig.tight_layout()
    fig.savefig(out, metadata={"Date": None})


main()
