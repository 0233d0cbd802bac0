# SPDX-License-Identifier: Apache-2.0
"""Plots `cargo xtask bench balance --timeline`: per event (rows), the p99 of each 250 ms window
of every round under each set-up (left) and worker 0's share of Envoy's weights (right).

usage: plot.py TIMELINE_CSV OUT_PNG
"""

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

EVENTS = [
    ("cold", "cold start (hog on CPU 0)", 0.0, 0.0),
    ("hog-appears", "a hog appears on CPU 0", 6.0, 6.0),
    ("hog-leaves", "the hog on CPU 0 goes away", 6.0, 6.0),
    ("burst", "the rate doubles for 2 s, 130/s to 260/s (hog)", 6.0, 8.0),
    ("replacement", "both workers replaced (hog)", 6.0, 6.0),
]
SETUPS = [
    ("orca", "CSWRR + ORCA, defaults", "tab:blue"),
    ("orca-ib", "CSWRR + in-band ORCA, defaults", "tab:purple"),
    ("orca-1s", "CSWRR + ORCA, 1 s samples, 2 s blackout", "tab:cyan"),
    ("lr", "LEAST_REQUEST", "tab:orange"),
]


def number(text):
    return float(text) if text != "" else None


def main():
    source, out = sys.argv[1], sys.argv[2]
    runs = defaultdict(list)
    with open(source, newline="") as f:
        for row in csv.DictReader(f):
            runs[(row["event"], row["setup"], row["round"])].append(row)
    fig, axes = plt.subplots(len(EVENTS), 2, figsize=(13, 3.0 * len(EVENTS)), squeeze=False)
    for r, (event, title, at, over) in enumerate(EVENTS):
        left, right = axes[r]
        for setup, label, color in SETUPS:
            first = True
            for (e, s, _round), rows in sorted(runs.items()):
                if e != event or s != setup:
                    continue
                t = [float(row["t_s"]) for row in rows]
                p99 = [number(row["p99_ms"]) for row in rows]
                # A failed window (None) is drawn at the top.
                top = max([p for p in p99 if p is not None] + [1.0])
                left.step(t, [p if p is not None else top for p in p99], where="post",
                          color=color, alpha=0.7, lw=1, label=label if first else None)
                shares = [(float(row["t_s"]), number(row["weight0_share"])) for row in rows
                          if row["weight0_share"] != ""]
                if shares and setup != "lr":
                    right.step([x for x, _ in shares], [y * 100 for _, y in shares], where="post",
                               color=color, alpha=0.7, lw=1, label=label if first else None)
                first = False
        for ax in (left, right):
            ax.axvspan(at, max(over, at + 0.05), color="grey", alpha=0.2)
            ax.set_xlim(0, 14)
            ax.grid(alpha=0.3)
        left.set_yscale("log")
        left.set_ylabel("p99 per 250 ms (ms)")
        left.set_title(title, fontsize=10)
        right.set_ylabel("worker 0's weight share (%)")
        right.set_ylim(0, 100)
        right.set_title(title + ": Envoy's weights", fontsize=10)
        if r == 0:
            left.legend(fontsize=8)
            right.legend(fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("seconds since the load started")
    fig.tight_layout()
    fig.savefig(out, dpi=90)


if __name__ == "__main__":
    main()
