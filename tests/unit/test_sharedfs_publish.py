"""Publishing a shared-fs chunk file never replaces an existing one: renameat2(RENAME_NOREPLACE)
where the filesystem has it, link + unlink where it does not (kvtier/tiers/sharedfs/io.py)."""

from __future__ import annotations

import os

import pytest

from kvtier.tiers.sharedfs import io as sio


def _files(tmp_path):
    a, b = tmp_path / "a.tmp", tmp_path / "b.tmp"
    a.write_text("first")
    b.write_text("second")
    return str(a), str(b), str(tmp_path / "final")


@pytest.mark.parametrize("fast", [True, False])
def test_publish_moves_once_and_a_duplicate_leaves_the_published_inode(tmp_path, monkeypatch, fast) -> None:
    if not fast:
        monkeypatch.setattr(sio, "_renameat2_ok", False)      # a filesystem without renameat2 flags
    a, b, final = _files(tmp_path)
    sio.publish(a, final)
    ino = os.stat(final).st_ino
    sio.publish(b, final)
    assert open(final).read() == "first" and os.stat(final).st_ino == ino
    assert not os.path.exists(a) and not os.path.exists(b)


def test_the_fast_path_is_one_rename_here(tmp_path, monkeypatch) -> None:
    """On ext4/tmpfs (this machine) renameat2 with RENAME_NOREPLACE works: no link is made."""
    if not sio._renameat2_ok:
        pytest.skip("this libc/filesystem has no renameat2")
    monkeypatch.setattr(os, "link", lambda *a: (_ for _ in ()).throw(AssertionError("link used")))
    a, _, final = _files(tmp_path)
    sio.publish(a, final)
    assert open(final).read() == "first"


def test_a_missing_leaf_directory_is_file_not_found(tmp_path) -> None:
    a, _, _ = _files(tmp_path)
    with pytest.raises(FileNotFoundError):
        sio.publish(a, str(tmp_path / "no-such-dir" / "final"))
