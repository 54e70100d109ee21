"""The cluster side of ``kvtier simulate | plan``: ``--replicas N --routing roundrobin|sticky|kv-aware``.

Every other option of the command applies to each replica; ``--shared-capacity`` is the
cluster's one shared tier. Bad values raise ``ValueError`` (the command prints one line).
Heavy imports stay inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from kvtier.commands.json_out import is_stdout, write_json_out
from kvtier.units import nbytes as fmt_bytes, percent, seconds

ROUTING_HELP = "With --replicas: roundrobin (request i -> replica i mod N), sticky (hash of the conversation id) " \
               "or kv-aware (longest prefix held by a replica's caches; ties: fewest in flight)."
REPLICAS_HELP = "Simulate a cluster of this many replicas behind one load balancer (one load, --routing); " \
                "the other options apply per replica, --shared-capacity is the cluster's shared tier."


def replicas_option() -> Any:
    return typer.Option(None, "--replicas", help=REPLICAS_HELP)


def routing_option() -> Any:
    return typer.Option(None, "--routing", help=ROUTING_HELP)


def check_cluster_options(replicas: Optional[int], routing: Optional[str]) -> str:
    """The routing to use; ValueError (one line) on a bad combination."""
    from kvtier.sim.routing import ROUTINGS
    if replicas is None:
        if routing is not None:
            raise ValueError("--routing needs --replicas")
        return "roundrobin"
    if replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {replicas}")
    routing = routing or "roundrobin"
    if routing not in ROUTINGS:
        raise ValueError(f"--routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    return routing


def bw(v: Optional[float]) -> str:
    return "–" if v is None else f"{fmt_bytes(v)}/s"


def simulate_cluster_command(trace, prof, load, replicas: int, routing: str, out: Optional[Path],
                             json_path: Optional[Path]) -> None:
    from kvtier.sim.cluster import run_cluster
    from kvtier.sim.run import write_json
    res = run_cluster(trace, prof, load, replicas, routing)
    d = res.to_dict()
    d["workload"] = trace.name
    if out is not None:
        write_json(out / "cluster.json", d)
    if json_path is not None:
        if is_stdout(json_path):
            write_json_out(json_path, d)
            return
        write_json(json_path, d)
    print_cluster(res, f"simulated cluster: {trace.name} ({trace.num_requests} requests), {replicas} replicas, "
                       f"{routing}")


def print_cluster(res, title: str) -> None:
    from rich.console import Console
    from rich.table import Table
    con = Console()
    con.print(title)
    con.print(f"requests {res.requests} served of {res.sent} sent ({res.failed} failed); token hit rate "
              f"{percent(res.token_hit_rate)}; TTFT mean {seconds(res.ttft_mean_s)}, p50 {seconds(res.ttft_p50_s)}, "
              f"p90 {seconds(res.ttft_p90_s)}; duration {seconds(res.duration_s)}")
    tiers = ", ".join(f"{k} {percent(v)}" for k, v in res.tier_hit_rate.items() if v)
    con.print(f"hit rate by tier: {tiers or 'none'}")
    if res.shared:
        con.print(f"shared tier reads: {fmt_bytes(res.shared_bytes_read)}, mean {bw(res.shared_read_bw)} in total, "
                  f"{bw(res.shared_read_bw / res.replicas)} per replica")
    t = Table(title="per replica")
    for col in ("replica", "requests", "token hit rate", "TTFT mean", "shared read"):
        t.add_column(col)
    for i, p in enumerate(res.per_replica):
        t.add_row(str(i), str(p.requests), percent(p.token_hit_rate), seconds(p.ttft_mean_s),
                  fmt_bytes(p.shared_bytes_read))
    con.print(t)


def plan_cluster_command(trace, prof, load, replicas: int, routing: str, target: float,
                         sample_rate: Optional[float], out: Optional[Path], json_path: Optional[Path]) -> None:
    from kvtier.sim.planner import make_cluster_plan
    p = make_cluster_plan(trace, prof, load, replicas=replicas, routing=routing, target=target,
                          sample_rate=sample_rate)
    from kvtier.commands.sim_cmd import write_plan

    if write_plan(p.to_dict(), out, json_path):
        return
    from rich.console import Console
    from rich.table import Table
    con = Console()
    lo = p.local_only
    con.print(f"{replicas} replicas, {routing}: ideal hit rate {percent(p.ideal_hit_rate)}; {target:.0%} of it needs a "
              f"shared tier of {fmt_bytes(p.knee_bytes)} (the whole trace's curve); local tiers only: hit rate "
              f"{percent(lo['token_hit_rate'])}, TTFT mean {seconds(lo['ttft_mean_s'])}")
    t = Table(title="shared tier candidates (simulated cluster)")
    for col in ("shared", "hit rate (curve)", "hit rate (sim)", "TTFT mean", "TTFT p90", "read bw mean",
                "read bw peak", "per replica (mean)", "meets"):
        t.add_column(col)
    for c in p.candidates:
        t.add_row(fmt_bytes(c.shared_bytes), percent(c.predicted_hit_rate), percent(c.token_hit_rate),
                  seconds(c.ttft_mean_s), seconds(c.ttft_p90_s), bw(c.shared_read_bw), bw(c.shared_read_bw_peak),
                  bw(c.shared_read_bw / replicas), "yes" if c.meets else "no")
    con.print(t)
    if p.best is None:
        con.print("no simulated shared tier size met the target")
