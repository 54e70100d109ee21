"""Compare soak runs' vLLM worker RSS (benchmarks/soak/soak.py output folders): at the same minute and
at the same number of requests served, each kvtier run minus the vanilla run of the same workload.

    python benchmarks/soak/compare.py --vanilla DIR --run LABEL=DIR [--run ...] --out compare.json [--png compare.png]

Requests served by minute m: requests of ``requests.jsonl`` that ended (start + e2e) by m, counted
from the replay's start (the first sample is taken when the replay starts, within a second).
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from verdict import MIB, read_samples, role  # noqa: E402

MINUTES = (1, 5, 10, 15, 20, 25, 30)


def worker_curve(folder: Path) -> list[tuple[float, float, int]]:
    """[(minute, worker RSS MiB, requests served by then)] for one run folder."""
    samples = read_samples(folder)
    t0 = samples[0]["t"]
    ends = sorted(r["start_s"] + r["e2e_s"] for r in map(json.loads, (folder / "requests.jsonl").read_text().splitlines())
                  if r.get("error_kind") is None and r.get("e2e_s") is not None)
    out = []
    for s in samples:
        w = next((p for p in s["procs"].values() if role(p["name"]) == "worker"), None)
        if w is not None:
            out.append(((s["t"] - t0) / 60, w["rss"] / MIB, bisect.bisect_right(ends, s["t"] - t0)))
    return out


def _interp(xs: list[float], ys: list[float], x: float) -> float | None:
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    i = bisect.bisect_left(xs, x)
    if xs[i] == x or i == 0:
        return ys[i]
    f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + f * (ys[i] - ys[i - 1])


def compare(vanilla: list[tuple[float, float, int]], run: list[tuple[float, float, int]]) -> dict:
    """Worker RSS of ``run`` and ``vanilla`` at the marked minutes, and the difference at the same
    minute and at the same requests served (vanilla's RSS interpolated where it had served as many)."""
    vm, vr, vn = [c[0] for c in vanilla], [c[1] for c in vanilla], [float(c[2]) for c in vanilla]
    rm, rr, rn = [c[0] for c in run], [c[1] for c in run], [c[2] for c in run]
    rows = []
    for m in MINUTES:
        r, v = _interp(rm, rr, m), _interp(vm, vr, m)
        if r is None:
            continue
        n = int(_interp(rm, [float(x) for x in rn], m) or 0)
        # vanilla's RSS when it had served n requests (vanilla serves fewer: only up to its total)
        first = next((i for i, x in enumerate(vn) if x >= n), None)
        v_same_n = None
        if first is not None:
            v_same_n = vr[first] if first == 0 else _interp(vn[first - 1:first + 1], vr[first - 1:first + 1], n)
        rows.append({"minute": m, "run_rss_mib": round(r), "requests_served": n,
                     "vanilla_rss_mib": v and round(v), "minus_vanilla_same_minute_mib": v and round(r - v),
                     "vanilla_rss_same_requests_mib": v_same_n and round(v_same_n),
                     "minus_vanilla_same_requests_mib": v_same_n and round(r - v_same_n)})
    return {"rows": rows, "run_requests": rn[-1], "vanilla_requests": int(vn[-1]),
            "run_rss_first_last_mib": [round(rr[0]), round(rr[-1])],
            "vanilla_rss_first_last_mib": [round(vr[0]), round(vr[-1])]}


def plot(curves: dict[str, list[tuple[float, float, int]]], vanilla_label: str, png: Path,
         kvtier_mib: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(3, 1, figsize=(9, 10))
    van = curves[vanilla_label]
    for label, c in curves.items():
        ax[0].plot([x[0] for x in c], [x[1] for x in c], marker=".", label=label)
        ax[1].plot([x[2] for x in c], [x[1] for x in c], marker=".", label=label)
        if label != vanilla_label:
            ms = [x[0] for x in c if _interp([v[0] for v in van], [v[1] for v in van], x[0]) is not None]
            d = [x[1] - _interp([v[0] for v in van], [v[1] for v in van], x[0]) for x in c if x[0] in ms]
            ax[2].plot(ms, d, marker=".", label=f"{label} - {vanilla_label}")
    if kvtier_mib:
        ax[2].axhline(kvtier_mib, color="red", linestyle="--", label="RAM tier + fixed staging + margin")
    ax[0].set(xlabel="minutes", ylabel="vLLM worker RSS (MiB)")
    ax[1].set(xlabel="requests served", ylabel="vLLM worker RSS (MiB)")
    ax[2].set(xlabel="minutes", ylabel="worker RSS minus vanilla's (MiB)")
    for a in ax:
        a.legend(fontsize=7)
    fig.suptitle("kvtier soak: vLLM worker RSS, kvtier runs vs vanilla vLLM (same workload)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vanilla", type=Path, required=True)
    ap.add_argument("--run", action="append", required=True, metavar="LABEL=DIR")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--kvtier-mib", type=float, default=None, help="a budget line on the difference panel")
    args = ap.parse_args(argv)
    try:
        runs = {}
        for item in args.run:
            label, eq, folder = item.partition("=")
            if not eq:
                raise ValueError(f"--run {item!r}: expected LABEL=DIR")
            runs[label] = worker_curve(Path(folder))
        van = worker_curve(args.vanilla)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {label: {"folder": item.partition("=")[2], **compare(van, c)} for (label, c), item in zip(runs.items(), args.run)}
    result["vanilla_folder"] = str(args.vanilla)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.png:
        plot({"vanilla": van, **runs}, "vanilla", args.png, args.kvtier_mib)
    print(json.dumps({k: v["rows"] for k, v in result.items() if isinstance(v, dict)}, indent=None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
