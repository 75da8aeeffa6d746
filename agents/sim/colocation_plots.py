"""PNG plots of a colocation run (matplotlib, Agg backend): inference load, allocation, training queue over time."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_all(p, w, res: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    modes = [m for m in ("split", "unified") if m in res]
    demand = w.demand_gpus().sum(axis=1)
    paths = []

    def hours(series):
        return np.array(series["t"]) / 3_600_000

    def save(fig, name):
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    # 1. inference load: demand vs ready replica capacity, per run
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 3.2 * len(modes)), sharex=True, squeeze=False)
    for ax, m in zip(axes[:, 0], modes):
        s = res[m]["_series"]
        h = hours(s)
        ax.plot(h, demand[:len(h)], lw=0.8, color="tab:red", label="inference demand (GPUs at SLO capacity)")
        ax.plot(h, s["ready_gpus"], lw=0.8, color="tab:blue", label="ready replica capacity (GPUs)")
        ax.set_ylabel("GPUs")
        ax.set_title(f"{m}: served within 30 s {res[m]['inference_served_within_30s_pct']:.3f} %, "
                     f"unmet {res[m]['unmet_inference_pct']:.3f} %", fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("simulated hours")
    save(fig, "colocation_load.png")

    # 2. allocation: GPUs held by inference and by training, stacked, against the fleet
    fig, axes = plt.subplots(len(modes), 1, figsize=(11, 3.2 * len(modes)), sharex=True, squeeze=False)
    for ax, m in zip(axes[:, 0], modes):
        s = res[m]["_series"]
        h = hours(s)
        inf = np.array(s["alloc_inference"]) / 1000
        trn = np.array(s["alloc_training"]) / 1000
        ax.stackplot(h, inf, trn, labels=["inference (held)", "training (held)"], colors=["tab:blue", "tab:green"],
                     alpha=0.7)
        ax.plot(h, demand[:len(h)], lw=0.7, color="tab:red", label="inference demand")
        ax.axhline(res[m]["fleet_gpus"], color="k", lw=0.8, ls="--", label="fleet")
        if m == "split":
            ax.axhline(res[m]["pools"].get("inference", 0), color="tab:purple", lw=0.8, ls=":",
                       label="inference pool")
        ax.set_ylabel("GPUs")
        ax.set_title(f"{m}: {res[m]['allocated_gpu_hours_pct']:.1f} % of GPU-hours allocated", fontsize=10)
        ax.legend(loc="lower right", fontsize=8, ncol=2)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("simulated hours")
    save(fig, "colocation_allocation.png")

    # 3. training queue: jobs and GPUs waiting, both runs on one axis
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for m, color in zip(modes, ("tab:orange", "tab:green")):
        s = res[m]["_series"]
        h = hours(s)
        a1.plot(h, s["waiting_jobs"], color=color, lw=0.9,
                label=f"{m} (mean queueing {res[m]['training_mean_queueing_s'] / 60:.0f} min)")
        a2.plot(h, s["waiting_gpus"], color=color, lw=0.9, label=m)
    a1.set_ylabel("training jobs waiting")
    a2.set_ylabel("GPUs asked by waiting jobs")
    a2.set_xlabel("simulated hours")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=8)
    save(fig, "colocation_queue.png")
    return paths
