"""One CLI vocabulary: help text on every option, canonical names only in --help, the old names as hidden
aliases that parse to the canonical parameter, ``--version``, the demo and importer listings, and the
number formatter used by the commands' progress lines and summaries."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import typer
from typer.core import TyperArgument, TyperOption
from typer.testing import CliRunner

from kvtier import __version__, cli, units
from kvtier.commands.aliases import Alias, aliased, alias_table, rewrite

ROOT = Path(__file__).resolve().parents[2]

# Names retired everywhere: no command may show them in --help (each is a hidden alias somewhere).
RETIRED = ("--step-tokens", "--max-batched", "--url", "--concurrency", "--rate", "--timeout-s", "--timeout",
           "--ram", "--ssd", "--disk", "--dir", "--shared-dir", "--shared-dir-other", "--shared-evict", "--repeat",
           "--max-prompt-length", "--ram-price", "--ssd-price", "--gpu-kv-tokens")

# The least a command needs on its command line to parse (required arguments and options).
MINIMAL: dict[str, list[str]] = {
    "bench run": ["wl.jsonl", "--base-url", "http://127.0.0.1:9"],
    "bench slo": ["wl.jsonl", "--base-url", "http://127.0.0.1:9"],
    "bench compare": ["wl.jsonl", "--configs", "c.yaml"],
    "simulate": ["wl.jsonl"],
    "plan": ["wl.jsonl"],
    "calibrate": ["--base-url", "http://127.0.0.1:9", "--out", "p.yaml"],
    "fsck": ["."],
    "stats": [],
    "serve": [],
    "workload companion": ["--out", "w.jsonl"],
    "workload longdoc": ["--out", "w.jsonl"],
    "workload import sharegpt": ["in.json", "--out", "w.jsonl"],
    "workload import vllm-multiturn": ["in.json", "--out", "w.jsonl"],
    "workload import evalscope": ["in.json", "--out", "w.jsonl"],
    "workload import mooncake": ["in.jsonl", "--out", "w.jsonl"],
}


@pytest.fixture(scope="module")
def root():
    if not cli.app.registered_groups or not any(c.name == "fsck" for c in cli.app.registered_commands):
        cli._register_all()
    return typer.main.get_command(cli.app)


def _commands(cmd, path: str = "") -> Iterator[tuple[str, object]]:
    subs = getattr(cmd, "commands", None)
    if subs is None:
        yield path, cmd
        return
    for name, sub in subs.items():
        yield from _commands(sub, f"{path} {name}".strip())


def _all(root) -> list[tuple[str, object]]:
    return list(_commands(root))


def test_every_visible_option_and_argument_has_help(root):
    missing = [f"{path} {'/'.join(p.opts) if isinstance(p, TyperOption) else p.name}"
               for path, cmd in _all(root) for p in cmd.params
               if isinstance(p, (TyperOption, TyperArgument)) and not getattr(p, "hidden", False)
               and not (getattr(p, "help", None) or "").strip()]
    assert not missing, missing


def test_every_command_has_a_help_page(root):
    runner = CliRunner()
    for path, _ in _all(root):
        r = runner.invoke(cli.app, [*path.split(), "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0 and "Usage:" in r.stdout, (path, r.output)


def test_no_command_shows_a_retired_or_aliased_name(root):
    shown = []
    for path, cmd in _all(root):
        visible = {o for p in cmd.params if isinstance(p, TyperOption) and not p.hidden
                   for o in (*p.opts, *p.secondary_opts)}
        old = set(RETIRED) | {a.old for a in alias_table(cmd) if a.old != a.new}
        shown += [f"{path} {name}" for name in sorted(visible & old)]
    assert not shown, shown


def test_every_alias_names_a_visible_canonical_option(root):
    for path, cmd in _all(root):
        visible = {o for p in cmd.params if isinstance(p, TyperOption) and not p.hidden for o in p.opts}
        for a in alias_table(cmd):
            assert a.new in visible, f"{path}: {a.old} -> {a.new}, which it does not have"


def _alias_cases() -> list[tuple[str, Alias]]:
    if not cli.app.registered_groups or not any(c.name == "fsck" for c in cli.app.registered_commands):
        cli._register_all()
    return [(path, a) for path, cmd in _commands(typer.main.get_command(cli.app)) for a in alias_table(cmd)]


def _sample(param) -> str:
    kind = getattr(param.type_descriptor, "annotation", None) if hasattr(param, "type_descriptor") else None
    text = str(kind or param.type).lower()
    if "int" in text or "float" in text:
        return str(max(3, int(getattr(param, "min", None) or 0)))
    if param.name in ("memory_capacity", "disk_capacity", "shared_capacity"):
        return "1GiB"
    return "x"


@pytest.mark.parametrize("path,alias", _alias_cases(), ids=lambda v: v if isinstance(v, str) else v.old)
def test_hidden_alias_parses_to_the_canonical_parameter(root, path, alias, capsys):
    cmd = dict(_all(root))[path]
    canonical = next(p for p in cmd.params if isinstance(p, TyperOption) and alias.new in p.opts)
    base = MINIMAL.get(path, [])
    if alias.implied is not None:                      # an old switch: `--json` alone means `--json -`
        args, expected = [*base, alias.old], alias.implied
    else:
        value = _sample(canonical)
        args, expected = [*base, alias.old, value], value
    ctx = cmd.make_context(path.split()[-1], args)
    got = ctx.params[canonical.name]
    assert str(got) == expected or got == type(got)(expected), (path, alias, got)
    err = capsys.readouterr().err
    assert err.count("deprecated") == 1 and alias.old in err and alias.new in err


def test_alias_rewrite_leaves_values_passthrough_and_longer_names_alone():
    aliases = [Alias("--rate", "--request-rate"), Alias("--json", "--json", implied="-")]
    said: list[str] = []
    args = ["--rate=2", "--rate-limit", "5", "--json", "out.json", "--", "--rate", "1"]
    assert rewrite(args, aliases, said.append) == ["--request-rate=2", "--rate-limit", "5", "--json", "out.json",
                                                   "--", "--rate", "1"]
    assert said == ["note: --rate is deprecated; use --request-rate"]
    assert rewrite(["--json", "--dry-run"], aliases) == ["--json", "-", "--dry-run"]


def test_alias_behaves_exactly_like_the_canonical_name():
    app = typer.Typer()

    @app.command(cls=aliased({"--rate": "--request-rate"}))
    def go(request_rate: float = typer.Option(1.0, "--request-rate", min=0.5, help="r")) -> None:
        typer.echo(f"rate={request_rate}")

    @app.command()
    def other() -> None:
        """Keep `go` a sub-command."""

    runner = CliRunner()
    new, old = runner.invoke(app, ["go", "--request-rate", "2"]), runner.invoke(app, ["go", "--rate", "2"])
    assert new.stdout == old.stdout == "rate=2.0\n"
    assert "deprecated" in old.stderr and "--rate" not in runner.invoke(app, ["go", "--help"]).stdout
    bad = runner.invoke(app, ["go", "--rate", "0.1"])
    assert bad.exit_code == 2 and "--request-rate" in bad.output


def test_version_prints_the_package_version(root):
    r = CliRunner().invoke(cli.app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"kvtier {__version__}"
    assert f'version = "{__version__}"' in (ROOT / "pyproject.toml").read_text()   # one version, two places


def test_demo_help_lists_its_demos_and_bare_demo_runs_companion(root, monkeypatch):
    from kvtier.commands import demo_cmd

    r = CliRunner().invoke(cli.app, ["demo", "--help"])
    assert r.exit_code == 0
    for name in ("companion", "longdoc", "slo"):
        assert name in r.stdout
    runs: list[tuple[str, bool, int | None]] = []
    monkeypatch.setattr(demo_cmd, "_run", lambda name, out, js, opts, dtype, columns=None, sizing=None:
                        runs.append((name, opts.quick, opts.max_num_batched_tokens)))
    runner = CliRunner()
    for args in (["demo"], ["demo", "--quick"], ["demo", "companion", "--quick"],
                 ["demo", "--step-tokens", "512"], ["demo", "longdoc", "--quick"], ["demo", "slo"]):
        res = runner.invoke(cli.app, args)
        assert res.exit_code == 0, (args, res.output)
    assert runs == [("companion", False, None), ("companion", True, None), ("companion", True, None),
                    ("companion", False, 512), ("longdoc", True, None), ("slo", False, None)]


def test_workload_import_help_lists_the_four_importers(root):
    from kvtier.workload import importers

    r = CliRunner().invoke(cli.app, ["workload", "import", "--help"])
    assert r.exit_code == 0
    for name in ("sharegpt", "vllm-multiturn", "mooncake", "evalscope"):
        assert name in r.stdout
    modules = {p.stem for p in Path(importers.__file__).parent.glob("*.py")} - {"__init__", "jsonread"}
    assert modules == {"chat", "mooncake", "evalscope"}   # chat = sharegpt + vllm-multiturn


def test_help_and_version_import_neither_torch_nor_vllm():
    code = ("import sys\nfrom kvtier import cli\ncli._register_all()\n"
            "for args in (['--help'], ['--version'], ['demo', '--help'], ['bench', 'run', '--help']):\n"
            "    try:\n        cli.app(args, prog_name='kvtier')\n    except SystemExit:\n        pass\n"
            "print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm')))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1] == "HEAVY []"


def test_json_dash_is_stdout_and_only_json(tmp_path):
    from kvtier.commands.json_out import write_json_out

    write_json_out(tmp_path / "a" / "b.json", {"x": 1.5, "p": tmp_path})
    assert json.loads((tmp_path / "a" / "b.json").read_text()) == {"x": 1.5, "p": str(tmp_path)}
    runner = CliRunner()
    r = runner.invoke(cli.app, ["fsck", str(tmp_path), "--json", "-", "--dry-run"])
    assert r.exit_code in (0, 1) and json.loads(r.stdout)["chunks"] == 0
    wl = tmp_path / "w.jsonl"
    assert runner.invoke(cli.app, ["workload", "companion", "--conversations", "2", "--out", str(wl)]).exit_code == 0
    r = runner.invoke(cli.app, ["workload", "stats", str(wl), "--json", "-"])
    assert r.exit_code == 0 and json.loads(r.stdout)["conversations"] == 2 and "distributions" in r.stderr
    r = runner.invoke(cli.app, ["workload", "stats", str(wl)])             # the tables are back on stdout
    assert r.exit_code == 0 and "distributions" in r.stdout


@pytest.mark.parametrize("fn,value,text", [
    (units.seconds, 4.882281019938867, "4.88 s"), (units.seconds, 0.0452, "45.2 ms"), (units.seconds, 123.4, "123 s"),
    (units.seconds, 0.5, "0.50 s"), (units.seconds, 0.0, "0.00 s"), (units.seconds, 5e-5, "50.0 us"),
    (units.seconds, 1800, "30.0 min"), (units.seconds, None, "–"), (units.seconds, float("nan"), "–"),
    (units.num_s, 4.882281019938867, "4.88"), (units.num_s, 0.4521, "0.452"), (units.num_s, 12.345, "12.3"),
    (units.ratio, 2.5432, "2.54x"), (units.ratio, 13.06, "13.1x"), (units.ratio, 412.4, "412x"),
    (units.percent, 0.63149, "63.1%"), (units.percent, 1.0, "100.0%"), (units.percent, None, "–"),
    (units.nbytes, 0, "0 B"), (units.nbytes, 512, "512 B"), (units.nbytes, 1.5 * 2**30, "1.50 GiB"),
    (units.nbytes, 12.3 * 2**20, "12.3 MiB"), (units.gbps, 2.5432, "2.54 GB/s"), (units.ms, 0.4213, "0.42 ms"),
    (units.count, 12345, "12,345"),
])
def test_number_formatter(fn, value, text):
    assert fn(value) == text
