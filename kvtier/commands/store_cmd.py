"""CLI for the store: ``kvtier fsck DIR`` and ``kvtier bench store``.

Registered once at top level (``COMMAND_MODULES`` group None); the benchmark is added
to the existing ``bench`` sub-app found on the top-level app.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

import typer

from kvtier.commands.aliases import JSON_SWITCH, aliased
from kvtier.commands.json_out import is_stdout, json_option, write_json_out
from kvtier.units import nbytes


def fsck(directory: Path = typer.Argument(..., help="Disk tier directory (store.disk.path)."),
         dry_run: bool = typer.Option(False, "--dry-run", help="Report only; change nothing."),
         quarantine: Path = typer.Option(None, "--quarantine", help="Move bad files into this directory "
                                         "instead of deleting them."),
         config: Path = typer.Option(None, "--config", help="kvtier YAML config: its store.disk.capacity is "
                                     "the budget usage is checked against (KVTIER_* env applies too)."),
         json_path: Path = json_option("the report")) -> None:
    """Verify every chunk file, the ledger, the manifest and the budget; remove (or quarantine)
    corrupt chunks, orphans and dead writers' temp files. Exit 0 = clean, 1 = problems found."""
    from kvtier.config import ConfigError, load_config
    from kvtier.tiers.fsck import check
    if not directory.is_dir():
        typer.echo(f"error: not a directory: {directory}", err=True)
        raise typer.Exit(2)
    try:
        capacity = load_config(config).store.disk.capacity
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if quarantine is not None and quarantine.resolve().is_relative_to(directory.resolve()):
        typer.echo(f"error: --quarantine {quarantine} must be outside the cache directory {directory}", err=True)
        raise typer.Exit(2)
    try:
        report = check(directory, repair=not dry_run, quarantine=quarantine, capacity=capacity)
    except OSError as e:
        typer.echo(f"error: cannot check {directory}: {e}", err=True)
        raise typer.Exit(2)
    if is_stdout(json_path):
        typer.echo(json.dumps(report.to_dict(), indent=1))
    else:
        if json_path is not None:
            write_json_out(json_path, report.to_dict())
        _print_fsck(report, dry_run, quarantine)
    raise typer.Exit(0 if report.clean else 1)


def _print_fsck(report, dry_run: bool, quarantine: Path | None) -> None:
    from rich.console import Console
    c = Console(soft_wrap=True)
    c.print(f"{report.namespaces} namespace(s), {report.chunks} chunk file(s): {report.ok} ok "
            f"({nbytes(report.bytes_ok)}), {len(report.bad)} bad, {len(report.orphans)} orphan(s), "
            f"{len(report.temp_files)} stale temp file(s), {len(report.stale_manifests)} stale manifest(s), "
            f"{len(report.ledger_wrong)} wrong ledger(s)")
    for u in report.usage:
        budget = f" of {nbytes(u.capacity)} budget" if u.capacity is not None else ""
        flag = " [red]OVER BUDGET[/red]" if u.over_budget else ""
        c.print(f"  disk tier {u.namespace}: {nbytes(u.bytes_on_disk)} on disk{budget}, "
                f"ledger {'missing' if u.ledger is None else nbytes(u.ledger)}{flag}")
    for path, kind in report.bad.items():
        c.print(f"  [red]{kind}[/red] {path}")
    for path, why in report.stale_manifests.items():
        c.print(f"  [yellow]stale manifest[/yellow] {path}: {why}")
    if dry_run:
        c.print(f"would {'quarantine' if quarantine else 'remove'} "
                f"{len(report.bad) + len(report.orphans) + len(report.temp_files)} file(s)")
    else:
        moved = f"quarantined {report.quarantined} file(s) in {quarantine}" if quarantine else \
            f"removed {report.removed} file(s)"
        c.print(f"{moved}; ledger fixed in {report.ledger_fixed} namespace(s), "
                f"{report.manifests_rewritten} manifest(s) rewritten")


def bench_store(disk_path: Path = typer.Option(None, "--disk-path", help="Directory on the disk to measure "
                                               "(default: <kvtier_home>/bench-store)."),
                volume: str = typer.Option("1GiB", "--volume", help="Bytes per model per disk pass."),
                quick: bool = typer.Option(False, "--quick", help="256MiB volume, fewer passes."),
                repeats: int = typer.Option(5, "--repeats", min=1, help="Rounds; in each, every tier pass is "
                                            "interleaved with its plain-I/O ceiling passes; figures are medians."),
                json_path: Path = json_option("the results"),
                md_path: Path = typer.Option(None, "--md", help="Write a Markdown report here (default with "
                                             "--json PATH: the same path with .md)."),
                shared: str = typer.Option("", "--shared", help="Also measure shared tiers vs their own client: "
                                           "comma list of valkey,mooncake."),
                shared_only: bool = typer.Option(False, "--shared-only", help="Measure only the --shared backends "
                                                 "(and --sharedfs)."),
                valkey: str = typer.Option("", "--valkey", help="Valkey URL for --shared (default: start a "
                                          "local throwaway server)."),
                mooncake: str = typer.Option("", "--mooncake", help="MASTER,METADATA_URL for --shared "
                                            "(default: start a local master + pool owner)."),
                sharedfs: Path = typer.Option(None, "--sharedfs", help="Also measure the shared-filesystem tier "
                                              "vs raw I/O in this directory on a shared mount."),
                sharedfs_read: Path = typer.Option(None, "--sharedfs-read", help="The same directory through a "
                                                   "second mount (reads come from there: 'the other machine')."))\
        -> None:
    """Store put/get throughput and latency per tier vs memcpy and the best plain I/O of the same files (median of rounds)."""
    import time

    from kvtier.bench.store_bench import run
    from kvtier.bench.store_bench_report import to_markdown
    from kvtier.config import kvtier_home, parse_size
    try:
        vol = parse_size("256MiB" if quick and volume == "1GiB" else volume)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--volume") from None
    log = (lambda m: typer.echo(m, err=True)) if is_stdout(json_path) else typer.echo   # stdout: the JSON only
    path = disk_path or kvtier_home() / "bench-store"
    for p, flag in ((sharedfs, "--sharedfs"), (sharedfs_read, "--sharedfs-read")):
        if p is not None and not p.is_dir():
            raise typer.BadParameter(f"{p} is not a directory", param_hint=flag)
    backends = [b.strip() for b in shared.split(",") if b.strip()]
    if shared_only and not backends and sharedfs is None:
        raise typer.BadParameter("--shared-only needs --shared valkey,mooncake or --sharedfs DIR",
                                 param_hint="--shared-only")
    if shared_only:
        from kvtier.bench.store_bench_files import machine
        path.mkdir(parents=True, exist_ok=True)
        result = {"machine": machine(path), "repeat": repeats}
    else:
        result = run(path, vol, quick, log=log, repeat=repeats)
    if backends:
        from kvtier.bench.store_bench_rounds import MODELS, TOKENS
        from kvtier.bench.store_bench_shared import run_shared
        eps: dict = {}
        if valkey:
            eps["valkey"] = {"url": valkey}
        if mooncake:
            master, _, meta = mooncake.partition(",")
            eps["mooncake"] = {"master": master, "metadata": meta or f"http://{master.split(':')[0]}:8080/metadata"}
        flat = run_shared(backends, MODELS["default"] * TOKENS, min(vol, 256 * 2**20), min(repeats, 3),
                          endpoints=eps, log=log)
        result["shared"] = {k: v for k, v in flat.items() if isinstance(v, dict)}
        result.update({k: v for k, v in flat.items() if not isinstance(v, dict)})
    if sharedfs is not None:
        from kvtier.bench.store_bench_sharedfs import bench_sharedfs
        sf = bench_sharedfs(sharedfs, sharedfs_read, volume=min(vol, 256 * 2**20), repeat=min(repeats, 3),
                            log=log)
        result["sharedfs"] = sf
        result.update({f"sharedfs.{k}": sf[k] for k in ("get_gbps", "put_gbps", "raw_get_gbps", "raw_put_gbps")})
    result["command"] = " ".join(shlex.quote(a) for a in ["kvtier", *sys.argv[1:]])
    result["cwd"] = os.getcwd()
    result["time"] = time.time()
    if is_stdout(json_path):
        write_json_out(json_path, result)
    elif json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1) + "\n")
        log(f"wrote {json_path}")
    if md_path is None and json_path is not None and not is_stdout(json_path):
        md_path = json_path.with_suffix(".md")
    if md_path:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        if shared_only:
            from kvtier.bench.store_bench_shared import shared_markdown
            m = result["machine"]
            text = "\n".join([f"# kvtier shared-tier benchmark", "", f"Command: `{result['command']}`", "",
                              f"Machine: {m['nproc']} CPUs ({m['cpu']}), kernel {m['kernel']}", *shared_markdown(result),
                              ""])
            if "sharedfs" in result:
                from kvtier.bench.store_bench_sharedfs import markdown_rows
                text += "\n" + "\n".join(markdown_rows(result["sharedfs"]))
        else:
            text = to_markdown(result)
        md_path.write_text(text)
        log(f"wrote {md_path}")


def register(app: typer.Typer) -> None:
    app.command("fsck", cls=aliased(JSON_SWITCH))(fsck)
    bench = next((g.typer_instance for g in app.registered_groups if g.name == "bench"), None)
    if bench is not None:
        bench.command("store", cls=aliased({"--dir": "--disk-path", "--repeat": "--repeats"}))(bench_store)
