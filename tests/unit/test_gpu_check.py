"""``kvtier doctor --gpu`` (``kvtier.transfer.gpu_check``) on the CPU: the views it builds are the ones
vLLM 0.32 makes, its round-trip and race checks pass with ``NoStreams`` and catch a copy into the wrong
block, its table and exit code, and its command line (exit 2 without a CUDA device, no vLLM import)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from kvtier.transfer import gpu_check
from kvtier.transfer.blocks import BlockCopier
from kvtier.transfer.gpu_check import SMALL, Race, Report, RoundTrip, Syncs, Timing
from kvtier.transfer.streams import NoStreams
from kvtier.transfer.views import derive_views

CPU = torch.device("cpu")
FP8 = [torch.uint8] + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])
ENV = [("device", "cpu")]


def copier(dtype: torch.dtype = torch.bfloat16, kind: type[BlockCopier] = BlockCopier) -> BlockCopier:
    s = SMALL
    layers = gpu_check.build_views(s.layers, s.heads, s.head_size, s.block_size, s.num_blocks, dtype, CPU)
    return kind(derive_views(layers, s.block_size), s.chunk_blocks, NoStreams())


class WrongBlock(BlockCopier):
    """Scatters every block into the block after the one asked for."""

    def scatter(self, block_ids, first_block, buf, layers=None):
        return super().scatter([(b + 1) % self.views.num_blocks for b in block_ids], first_block, buf, layers)


@pytest.mark.parametrize("dtype", [torch.bfloat16, *FP8], ids=str)
def test_views_are_the_ones_vllm_makes(dtype):
    blocks, layers = 5, 3
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=dtype)
    strides = compute_layout_strides(spec, blocks, layers, KVCacheLayout.LBHNC)
    size = layers * blocks * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=[f"model.layers.{i}.attn" for i in range(layers)],
                           layer_stride=strides[0], block_stride=strides[1])
    theirs = create_kv_cache_views(torch.zeros(size, dtype=torch.int8), spec, blocks, KVCacheLayout.LBHNC, tensor)
    ours = gpu_check.build_views(layers, 8, 128, 16, blocks, dtype, "cpu")
    assert ours[0].untyped_storage().nbytes() == size
    for a, b in zip(ours, theirs):
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (b.shape, b.stride(), b.storage_offset(), b.dtype)
    kv = derive_views(ours, 16)
    assert kv.layout.name == "lbhnc" and kv.stacked is not None


def test_round_trip_and_race_pass_on_the_cpu():
    c = copier()
    trip = gpu_check.round_trip(c, SMALL)
    assert trip == RoundTrip("bfloat16", "lbhnc", True, SMALL.layers * SMALL.chunks * SMALL.chunk_blocks, 0)
    assert trip.ok
    assert gpu_check.race(c, SMALL).ok
    control = gpu_check.race(c, SMALL, follow=False)
    assert not control.followed and control.mismatched == 0        # the CPU runs every copy in order
    assert gpu_check.round_trip(copier(torch.uint8), SMALL).ok


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without float8")
def test_float8_round_trip_on_the_cpu():     # pages move as bytes: no float8 copy kernel is needed
    assert gpu_check.round_trip(copier(torch.float8_e4m3fn), SMALL).ok


def test_a_copy_into_the_wrong_block_is_a_mismatch():
    c = copier(kind=WrongBlock)
    trip = gpu_check.round_trip(c, SMALL)
    race = gpu_check.race(c, SMALL)
    assert trip.mismatched > 0 and not trip.ok
    assert race.mismatched > 0 and not race.ok
    report = Report(ENV, round_trips=[trip], races=[race])
    assert gpu_check.exit_code(report) == 1
    assert [r[1] for r in gpu_check.rows(report) if r[0] in ("round trip bfloat16", "load after a busy compute stream")] \
        == ["FAIL", "FAIL"]


def test_rows_and_exit_code():
    good = RoundTrip("bfloat16", "lbhnc", True, 64, 0)
    report = Report(ENV, round_trips=[good], races=[Race(True, 64, 0), Race(False, 64, 64)],
                    syncs=Syncs(32, 0, None, 31),
                    timings=[Timing("load", 8192, 2**30, 0.05, 0.045), Timing("save", 8192, 2**30, 0.1, 0.05)])
    rows = {check: (status, detail) for check, status, detail in gpu_check.rows(report)}
    assert rows["device"] == ("", "cpu")
    assert rows["round trip bfloat16"] == ("ok", "views lbhnc, one [L, B, page] view; 64 pages bit-exact")
    assert rows["load after a busy compute stream"][0] == "ok"
    assert rows["  same load without follow_compute"] == ("info", "race observed: 64 of 64 pages not as stored")
    assert rows["host syncs per load (32 chunks)"] == ("info", "0 (torch sync debug mode)")
    assert rows["host syncs per save (32 chunks)"][1].startswith("n/a")
    assert rows["save claims that waited"] == ("info", "31 of 32")
    assert rows["load 8192 tokens (1.00 GiB)"] == ("met", "kvtier 21.5 GB/s, torch copy_ 23.9 GB/s: 0.90 (target >= 0.8)")
    assert rows["save 8192 tokens (1.00 GiB)"][0] == "not met"
    assert gpu_check.exit_code(report) == 0             # the control's race and a missed rate target are information
    for bad in (Report(ENV, round_trips=[RoundTrip("uint8", "lbhnc", False, 64, 0)]),   # not one allocation
                Report(ENV, races=[Race(True, 64, 1)]),
                Report(ENV, errors=[("round trip float8_e4m3fn", "NotImplementedError: no kernel")])):
        assert gpu_check.exit_code(bad) == 1
    assert gpu_check.rows(bad)[-1] == ("round trip float8_e4m3fn", "FAIL", "NotImplementedError: no kernel")


def test_run_checks_on_the_cpu():
    report = gpu_check.run_checks(SMALL, "cpu", torch.uint8, repeats=1)
    assert not report.errors and gpu_check.exit_code(report) == 0
    assert [r.dtype for r in report.round_trips] == ["bfloat16", "uint8"]
    assert [r.followed for r in report.races] == [True, False]
    assert report.syncs == Syncs(SMALL.chunks, None, None, 0)
    assert [t.direction for t in report.timings] == ["load", "save"]


def test_shape_options():
    _, shape = gpu_check.parse_args(["--small", "--chunk-tokens", "32", "--tokens", "128"])
    assert (shape.layers, shape.chunk_blocks, shape.chunks) == (SMALL.layers, 2, 4)
    assert gpu_check.parse_args([])[1] == gpu_check.Shape()
    for bad in (["--tokens", "100"], ["--small", "--num-blocks", "8"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_command_line_without_cuda():
    done = run("-m", "kvtier.transfer.gpu_check")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("no CUDA device: ") and done.stderr.count("\n") == 1
    done = run("-m", "kvtier.transfer.gpu_check", "--device", "cpu", "--small", "--repeats", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "round trip float8_e4m3fn" in done.stdout and "load after a busy compute stream" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_doctor_gpu_runs_only_the_gpu_check_without_vllm():
    code = ("import sys; from typer.testing import CliRunner; from kvtier import cli; cli._register_all(); "
            "r = CliRunner().invoke(cli.app, ['doctor', '--gpu']); "
            "print(r.exit_code, 'vllm' in sys.modules); print(r.output)")
    done = run("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("2 False\nno CUDA device: ")


def test_plain_table_without_rich(monkeypatch, capsys):
    """A GPU machine may have torch alone: the table is then plain text."""
    monkeypatch.setitem(sys.modules, "rich.console", None)
    report = Report(gpu_check.environment(torch.device("cpu"), SMALL),
                    round_trips=[RoundTrip("bfloat16", "lbhnc", True, 64, 0)])
    gpu_check.print_table(report)
    out = capsys.readouterr().out
    assert out.startswith("kvtier GPU check\n") and "round trip bfloat16  ok" in out and "64 pages bit-exact" in out
