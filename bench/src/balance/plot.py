# SPDX-License-Identifier: Apache-2.0
"""Plots `cargo xtask bench balance`: per scenario (columns), over the first round's runs,
worker 0's share of the requests under each policy with CSWRR's weight share (out of band and in
band), both workers' utilization under CSWRR (out of band), and Envoy's CSWRR weights (both).

usage: plot.py REQUESTS_CSV SAMPLES_CSV OUT_PNG WARMUP_SECS DURATION_SECS
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import LogLocator, ScalarFormatter  # noqa: E402

SCENARIOS = [
    ("hog", "A: a CPU hog shares worker 0's core"),
    ("side", "B: CPU-heavy requests to worker 0, past Envoy"),
]
POLICIES = [
    ("rr", "ROUND_ROBIN", "tab:red"),
    ("lr", "LEAST_REQUEST", "tab:orange"),
    ("orca", "CSWRR + ORCA", "tab:blue"),
    ("orca-ib", "CSWRR + in-band ORCA", "tab:cyan"),
    ("reuseport", "SO_REUSEPORT hyper (no balancer)", "tab:gray"),
]
ROUND = "1"
WORKERS = [("0", "tab:purple"), ("1", "tab:green")]


def number(text):
    return float(text) if text != "" else None


def sampled(rows, column, value=None):
    """The times of the rows where `column` was sampled, and there `value(row)` (by default the
    column's number)."""
    rows = [s for s in rows if s[column] != ""]
    return ([float(s["t_s"]) for s in rows],
            [value(s) if value else number(s[column]) for s in rows])


def step(ax, rows, column, value=None, **style):
    """Draws `sampled(rows, column, value)` as steps (each value holds until the next sample)."""
    t, values = sampled(rows, column, value)
    ax.step(t, values, where="post", **style)


def busy_cores(sample, worker):
    """A worker's CPU plus run-queue wait, in cores."""
    return number(sample["cpu" + worker]) + (number(sample["wait" + worker]) or 0.0)


def read(path):
    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if row["round"] == ROUND]


def main():
    requests_csv, samples_csv, out, warmup, duration = sys.argv[1:6]
    warmup, duration = float(warmup), float(duration)
    requests, samples = read(requests_csv), read(samples_csv)

    fig, axes = plt.subplots(3, 2, figsize=(13, 10), sharex="col")
    for col, (scenario, title) in enumerate(SCENARIOS):
        share_ax, busy_ax, weight_ax = axes[:, col]
        share_ax.set_title(title)
        for ax in axes[:, col]:
            ax.axvspan(0, warmup, color="0.92", zorder=0)
            ax.axvline(warmup + duration, color="0.6", linewidth=0.8)
            ax.grid(True, linewidth=0.3)

        for policy, label, color in POLICIES:
            rows = [r for r in requests if r["scenario"] == scenario and r["policy"] == policy]
            t, share = [], []
            for r in rows:
                total = int(r["worker0"]) + int(r["worker1"])
                if total:
                    t.append(float(r["t_s"]) + 0.25)
                    share.append(int(r["worker0"]) / total)
            share_ax.plot(t, share, color=color, linewidth=1.2, label=label)

        orca = [s for s in samples if s["scenario"] == scenario and s["policy"] == "orca"]
        in_band = [s for s in samples if s["scenario"] == scenario and s["policy"] == "orca-ib"]
        for rows, color, label in [(orca, "black", "CSWRR"), (in_band, "tab:cyan", "in band")]:
            t, weight_share = [], []
            for s in rows:
                w0, w1 = number(s["weight0"]), number(s["weight1"])
                if w0 is not None and w1 is not None and w0 + w1 > 0:
                    t.append(float(s["t_s"]))
                    weight_share.append(w0 / (w0 + w1))
            share_ax.plot(t, weight_share, color=color, linestyle="--", linewidth=1,
                          label=f"{label}: worker 0's share of Envoy's weights")
        share_ax.axhline(1 / 3, color="0.4", linestyle=":", linewidth=1,
                         label="worker 0's share of the capacity (1/3)")
        share_ax.set_ylim(0, 0.8)
        share_ax.set_ylabel("worker 0's share of requests\n(per 500 ms, by send time)")
        share_ax.legend(fontsize=7, loc="upper right")

        for worker, color in WORKERS:
            step(busy_ax, orca, "cpu" + worker, lambda s: busy_cores(s, worker), color=color,
                 linewidth=1.2, label=f"CSWRR worker {worker}: CPU + run-queue wait")
            step(busy_ax, orca, "cpu" + worker, color=color, linewidth=0.8, linestyle=":",
                 label=f"CSWRR worker {worker}: CPU")
        rr = [s for s in samples if s["scenario"] == scenario and s["policy"] == "rr"]
        step(busy_ax, rr, "cpu0", lambda s: busy_cores(s, "0"), color="tab:red", linewidth=0.8,
             alpha=0.6, label="ROUND_ROBIN worker 0: CPU + run-queue wait")
        busy_ax.set_ylim(0, 1.15)
        busy_ax.set_ylabel("cores (sampled every 1 s)")
        busy_ax.legend(fontsize=7, loc="lower right")

        for worker, color in WORKERS:
            step(weight_ax, orca, "weight" + worker, color=color, linewidth=1.2,
                 label=f"worker {worker}")
            step(weight_ax, in_band, "weight" + worker, color=color, linewidth=1.0,
                 linestyle="--", label=f"worker {worker}, in band")
        weight_ax.set_yscale("log")
        weight_ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        weight_ax.yaxis.set_major_formatter(ScalarFormatter())
        weight_ax.yaxis.set_minor_formatter(ScalarFormatter())
        weight_ax.tick_params(axis="y", which="minor", labelsize=7)
        weight_ax.set_ylabel("Envoy's CSWRR weight\n(admin /clusters, log scale)")
        weight_ax.set_xlabel("seconds since the run's start (grey: warm-up)")
        weight_ax.legend(fontsize=7, loc="upper right")

    fig.suptitle("Worker 0 shares its core: what each policy sends it, and what CSWRR's weights did "
                 "(round 1)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()
