# SPDX-License-Identifier: Apache-2.0
"""Plots `cargo xtask bench balance --waits`: per cell (a panel each, three to a row), the p99 of
every set-up, the median over rounds as a bar and each round as a dot (`SO_REUSEPORT`'s dots with
worker 0's share in that round: the kernel's split).

usage: waits_plot.py CSV OUT_PNG
"""

import csv
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402

CELLS = [
    ("io", "io: waits of 5 ms (90%) / 100 ms (10%)"),
    ("slow-worker", "slow-worker: worker 0 waits 5x longer"),
    ("cpu-hog", "cpu-hog: 4 ms CPU, hog on worker 0's core"),
    ("four-envoys", "four-envoys: io behind 4 Envoys"),
    ("async-io", "async-io: uvicorn, waits that block nothing"),
    ("async-hog", "async-hog: uvicorn, 4 ms CPU, hog on worker 0's core"),
    ("two-hosts", "two-hosts: host b waits 2x longer, an Envoy each"),
]
# The cells whose server is uvicorn: its own socket is uvicorn's, and Peregrine's default for it is
# a listener each, balanced on ORCA.
ASYNC_CELLS = {"async-io", "async-hog"}
ASYNC_LABELS = {
    "shared-socket": "uvicorn shared socket",
    "shared": "a listener each, ORCA\n(default)",
}
# Panels per row.
COLUMNS = 3
SETUPS = [
    ("shared-socket", "gunicorn shared socket", "tab:gray"),
    ("orca", "ORCA, a listener each\n(former default)", "tab:blue"),
    ("lr2", "least request, 2", "tab:orange"),
    ("lr4", "least request, all", "tab:red"),
    ("rr", "round robin", "tab:purple"),
    ("reuseport", "SO_REUSEPORT", "tab:brown"),
    ("shared", "shared listener\n(default)", "tab:green"),
    ("shared-orca", "shared listener,\nORCA between hosts", "tab:olive"),
]


def main():
    path, out = sys.argv[1], sys.argv[2]
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    cells = [(key, title) for key, title in CELLS if any(r["cell"] == key for r in rows)]
    columns = min(max(len(cells), 1), COLUMNS)
    lines = -(-max(len(cells), 1) // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(5 * columns, 4.5 * lines), squeeze=False)
    panels = [ax for line in axes for ax in line]
    for ax in panels[len(cells):]:
        ax.set_visible(False)
    for ax, (cell, title) in zip(panels, cells):
        names, x, panel_p99 = [], 0, []
        for key, label, color in SETUPS:
            if cell in ASYNC_CELLS:
                label = ASYNC_LABELS.get(key, label)
            runs = [r for r in rows if r["cell"] == cell and r["setup"] == key]
            if not runs:
                continue
            p99 = [float(r["p99_ms"]) for r in runs if r["p99_ms"] != ""]
            panel_p99.extend(p99)
            failed = len(runs) - len(p99)
            if p99:
                ax.bar(x, statistics.median(p99), color=color, alpha=0.7)
                ax.plot([x] * len(p99), p99, "k.", markersize=4)
            if key == "reuseport":
                # Each round is one draw of the kernel's split: worker 0's share beside its dot.
                for r in runs:
                    if r["p99_ms"] != "" and r.get("shares"):
                        ax.annotate(f"{r['shares'].split('/')[0]}%", (x, float(r["p99_ms"])),
                                    xytext=(4, 0), textcoords="offset points", fontsize=6,
                                    va="center")
            if failed:
                # On a failed request (a timeout): at the panel's foot, as the log scale has no 0.
                ax.annotate(f"{failed} of {len(runs)} rounds failed", (x, 0.03),
                            xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                            ha="center", va="bottom")
            names.append(label)
            x += 1
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
        ax.set_yscale("log")
        # Plain figures at 1, 2 and 5 of each decade, and at least a factor of 4 from foot to top, so
        # that a panel whose set-ups all sit at one floor (async-io) shows them level.
        ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        if panel_p99:
            low, high = min(panel_p99), max(panel_p99)
            ax.set_ylim(low / 2, max(high * 1.5, low * 4))
        ax.set_ylabel("p99 (ms), median of rounds; dots: rounds")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", which="both", alpha=0.3)
    fig.suptitle("gunicorn sync workers and uvicorn behind Envoy: p99 per set-up", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
