"""``kvtier bench encoding`` without vLLM: the output-agreement figures, the codec figures on chunk files
of a disk tier, the store passes on a plain shared directory, a shared tier seeded in an encoding, the
options' checks, the report, and the command's one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvtier.bench.encoding_bench import ROLES, EncodingOptions, EncodingReport
from kvtier.bench.encoding_quality import Generation, agreement, common_prefix
from kvtier.chunk import ChunkMeta, file_size
from kvtier.keys import Namespace, chunk_keys
from kvtier.metrics import Telemetry
from kvtier.tiers.disk import DiskTier

pytest.importorskip("zstandard")

SHAPE = (2, 1, 1, 16, 32)            # [layers, blocks, kv_heads, block tokens, K and V channels]
NS = Namespace("m", "f", "float32", "lbhnc", 16, 16)


def _gen(tokens: list[int], lps: list[float]) -> Generation:
    return Generation(tuple(tokens), tuple(lps))


# -- agreement ----------------------------------------------------------------------------------------
def test_agreement_counts_prefix_positions_and_logprob_deltas_before_the_divergence() -> None:
    ref = [_gen([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), _gen([5, 6, 7, 8], [-1.0, -1.0, -1.0, -1.0])]
    test = [_gen([1, 2, 3, 4], [-0.1, -0.25, -0.3, -0.4]),           # identical, one delta of 0.05
            _gen([5, 6, 9, 8], [-1.5, -1.0, -9.0, -9.0])]            # diverges at 2; equal again at 3
    a = agreement(ref, test)
    assert (a.prompts, a.tokens, a.identical, a.identical_share) == (2, 4, 1, 0.5)
    assert a.first_divergence == (None, 2)
    assert a.prefix_share == pytest.approx((4 / 4 + 2 / 4) / 2)
    assert a.position_share == pytest.approx((4 / 4 + 3 / 4) / 2)
    # positions 0-3 of the first prompt and 0-1 of the second; never position 2 or 3 of the second
    assert a.positions_compared == 6
    assert a.mean_abs_dlogprob == pytest.approx((0.05 + 0.5) / 6)
    assert a.max_abs_dlogprob == pytest.approx(0.5)
    assert a.first_token_abs_dlogprob == pytest.approx((0.0 + 0.5) / 2)


def test_agreement_with_no_common_token_has_no_logprob_figures() -> None:
    a = agreement([_gen([1, 2], [-1.0, -1.0])], [_gen([3, 2], [-2.0, -1.0])])
    assert (a.identical, a.prefix_share, a.position_share, a.positions_compared) == (0, 0.0, 0.5, 0)
    assert a.mean_abs_dlogprob is None and a.first_token_abs_dlogprob is None


@pytest.mark.parametrize("ref,test", [([], []), ([_gen([1], [0.0])], []),
                                      ([_gen([1, 2], [0.0, 0.0])], [_gen([1], [0.0])])])
def test_agreement_refuses_outputs_that_do_not_pair_up(ref, test) -> None:
    with pytest.raises(ValueError):
        agreement(ref, test)


def test_generation_needs_one_logprob_per_token_and_common_prefix() -> None:
    with pytest.raises(ValueError):
        Generation((1, 2), (0.0,))
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0


# -- codec and stores on real chunk files ----------------------------------------------------------------
def _kv(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(SHAPE).astype(np.float32) * rng.uniform(0.05, 8, SHAPE[-1]).astype(np.float32)
    return x.tobytes()


def _ssd(tmp_path: Path, n: int = 6) -> Path:
    d = tmp_path / "ssd"
    tier = DiskTier.open(d, NS, 1 << 30, telemetry=Telemetry())
    keys = chunk_keys(NS, list(range(16 * n)))
    for i, k in enumerate(keys):
        p = _kv(i)
        assert tier.put(ChunkMeta(k, keys[i - 1] if i else None, 16, SHAPE, "float32", len(p)), p)
    tier.flush(30)
    tier.close()
    return d


def test_codec_rows_on_chunk_files(tmp_path: Path) -> None:
    from kvtier.bench.encoding_codec import measure_codecs

    rows = {r.encoding: r.to_json() for r in measure_codecs(_ssd(tmp_path), log=lambda m: None)}
    plain, zstd, int8 = rows["plain"], rows["zstd"], rows["int8"]
    n = 2 * 16 * 32 * 4
    assert all(r["chunks"] == 6 and r["tokens"] == 96 and r["plain_bytes"] == 6 * n for r in rows.values())
    assert plain["ratio"] == 1.0 and plain["exact"] is True and plain["bytes_per_token"] == n / 16
    assert zstd["exact"] is True and zstd["ratio"] > 1.0         # random mantissas, but shuffled exponents
    # int8: one byte per element + a float32 scale per (group, channel) + the frame header
    frame = 2 * 16 * 32 + 4 * 2 * 32 + 16 + 12
    assert int8["ratio"] == pytest.approx(n / frame, rel=1e-3)
    assert 0 < int8["rel_rms_error_mean"] <= int8["rel_rms_error_max"] < 0.02
    assert int8["encode_mbps"] > 0 and int8["decode_mbps"] > 0


def test_store_passes_on_a_shared_directory(tmp_path: Path) -> None:
    from kvtier.bench.encoding_stores import load_payloads, measure_stores, rotate
    from kvtier.bench.shared_seed import SharedTarget

    pl = load_payloads(_ssd(tmp_path), volume=4 * 2 * 16 * 32 * 4)
    assert len(pl.metas) == 4 and pl.tokens == 64
    shared = tmp_path / "shared"
    shared.mkdir()
    cfg = {"kind": "sharedfs", "path": str(shared)}
    rows = measure_stores([SharedTarget("sharedfs", cfg, cfg)], [pl], ("plain", "zstd", "int8"), 2,
                          log=lambda m: None)
    by = {r["encoding"]: r for r in rows}
    assert set(by) == {"plain", "zstd", "int8"} and all(r["rounds"] == 2 for r in rows)
    assert by["plain"]["stored_bytes_per_token"] == pytest.approx(file_size(2 * 16 * 32 * 4) / 16, abs=0.05)
    int8_frame = 2 * 16 * 32 + 4 * 2 * 32 + 16 + 12          # the chunk's 4 KiB header weighs at this size
    assert by["plain"]["stored_vs_plain"] == 1.0
    assert by["int8"]["stored_vs_plain"] == pytest.approx(file_size(int8_frame) / file_size(2 * 16 * 32 * 4), abs=1e-4)
    assert all(r["get_mbps"] > 0 and r["get_chunks_per_s"] > 0 for r in rows)
    assert not any(shared.iterdir())                     # every round's chunks removed
    assert rotate(("a", "b", "c"), 1) == ("b", "c", "a") and rotate(("a", "b"), 2) == ("a", "b")


def test_seeded_shared_tier_holds_the_encoding_it_was_given(tmp_path: Path) -> None:
    from kvtier.bench.shared_seed import seed_shared
    from kvtier.config import SharedFsConfig
    from kvtier.tiers.protocol import Deadline
    from kvtier.tiers.registry import open_shared_backend

    ssd = _ssd(tmp_path, n=3)
    shared = tmp_path / "shared"
    res = seed_shared(ssd, {"kind": "sharedfs", "path": str(shared), "create": True, "janitor": False,
                            "encoding": "int8"}, log=lambda m: None)
    assert res.ok and res.chunks == 3
    keys = chunk_keys(NS, list(range(48)))
    for enc, found in (("int8", 3), ("plain", 0)):
        tier = open_shared_backend(SharedFsConfig(path=shared, janitor=False, encoding=enc), NS, Telemetry())
        try:
            assert tier.longest_prefix(keys, Deadline.after(5)).num_chunks == found
            if found:
                out = memoryview(bytearray(len(_kv(0))))
                assert tier.read_into([keys[0]], [out], Deadline.after(5))[0].ok
                x, y = np.frombuffer(_kv(0), np.float32), np.frombuffer(out, np.float32)
                assert not np.array_equal(x, y) and np.allclose(x, y, atol=float(np.abs(x).max()) / 127)
        finally:
            tier.close()


# -- options, report, command line -----------------------------------------------------------------------
@pytest.mark.parametrize("kw,needle", [
    ({"dtypes": ("float16",)}, "--dtypes"), ({"dtypes": ("bfloat16",)}, "must include float32"),
    ({"roles": ("codec", "bogus")}, "--roles"), ({"roles": ("write-bfloat16",), "dtypes": ("float32",)}, "write-bfloat16"),
    ({"roles": ()}, "add --resume"), ({"documents": 0}, "--documents"), ({"sharedfs_read": Path("/x")}, "--sharedfs-read needs --sharedfs")])
def test_options_name_the_bad_one(kw, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        EncodingOptions(model="m", workdir=Path("w"), **kw).check()


def test_roles_run_in_their_fixed_order_and_only_for_the_dtypes() -> None:
    o = EncodingOptions(model="m", workdir=Path("w"), dtypes=("float32",), roles=("read-int8", "codec", "write-float32"))
    assert o.run_roles() == ("write-float32", "codec", "read-int8")
    assert "write-bfloat16" not in EncodingOptions(model="m", workdir=Path("w"), dtypes=("float32",)).run_roles()
    assert EncodingOptions(model="m", workdir=Path("w")).run_roles() == ROLES
    report_only = EncodingOptions(model="m", workdir=Path("w"), roles=(), resume=True)
    report_only.check()
    assert report_only.run_roles() == ()


def test_report_markdown_has_every_section() -> None:
    from kvtier.bench.encoding_report import report_markdown

    q = agreement([_gen([1, 2], [-0.1, -0.2])], [_gen([1, 3], [-0.2, -0.2])]).to_json()
    r = EncodingReport(command="kvtier bench encoding", machine={"cpu": "X", "cpus": 2}, model="m", options={},
                       prompts={"count": 1, "min_tokens": 900, "max_tokens": 900},
                       codec=[{"dtype": "float32", "encoding": "int8", "chunks": 1, "plain_bytes_per_token": 4.0,
                               "bytes_per_token": 1.0, "ratio": 4.0, "encode_mbps": 1.0, "decode_mbps": 2.0,
                               "rel_rms_error_mean": 0.01, "rel_rms_error_max": 0.02}],
                       stores=[{"backend": "valkey", "dtype": "float32", "encoding": "zstd", "chunks": 1, "rounds": 3,
                                "stored_bytes_per_token": 3.0, "stored_vs_plain": 0.75, "put_mbps": 1.0,
                                "get_mbps": 2.0, "get_chunks_per_s": 3.0, "get_vs_plain": 0.9}],
                       quality={"int8": {**q, "proved_prompts": 1, "loaded_tokens": 768, "prompt_tokens": 900}},
                       violations=["read-int8 prompt 0: nothing loaded"])
    md = report_markdown(r)
    for needle in ("## Codecs on real chunks", "## Real stores", "## Output against float32 recompute",
                   "| int8 | 0 / 1 (0.0%) | 50.0% |", "768 of 900", "## Violations", "nothing loaded"):
        assert needle in md, needle


@pytest.mark.parametrize("args,needle", [(["--roles", "codec,nope"], "--roles"), (["--dtypes", "float16"], "--dtypes"),
                                         (["--volume", "lots"], "--volume"),
                                         (["--sharedfs", "/nonexistent/dir"], "is not a directory")])
def test_bad_command_line_is_one_line_naming_the_problem(args, needle, tmp_path: Path) -> None:
    from kvtier import cli
    from tests.unit.test_cli_lab import _one_line_error

    if not any(c.name == "fsck" for c in cli.app.registered_commands):
        cli._register_all()
    r = CliRunner().invoke(cli.app, ["bench", "encoding", "--workdir", str(tmp_path / "w"), *args],
                           env={"COLUMNS": "200"})
    _one_line_error(r, needle, code=2)
    assert not (tmp_path / "w").exists()                  # nothing ran
