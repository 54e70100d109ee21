"""The tracked tree speaks of the product only, and carries no logs.

Every tracked text file is read (the repository's own files, as ``git ls-files`` lists them) and
searched for words that describe how the project was worked on rather than what it is: numbered
work rounds, issue numbers, the people or processes that did the work. The project's history lives
in git, not in its files. Committed ``*.log`` files are refused too (``.gitignore`` ignores them).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Words about the work, not the product. Each alternative is a whole phrase, case-insensitive.
HISTORY_WORDS = re.compile(
    r"\bsessions? \d+"                 # the word, a space and a number
    r"|\bsession's\b"                  # "last session's run"
    r"|\bissues? #?\d+"                # "issue 10", "issue #11"
    r"|\(#\d+\)"                       # "(#12)"
    r"|\bwork rounds?\b"
    r"|\b(?:other|another|the) helpers?(?:'s|')?(?!\w)(?! (?:thread|function|pool|process|module|class))"
    r"|\bhelperload\b|-lent-|\blent run\b"
    r"|\bthe lead\b|\blead's\b",
    re.IGNORECASE,
)

#: Binary or data files that are not prose (searched by extension).
SKIP_SUFFIXES = {".png", ".jpg", ".gguf", ".safetensors", ".jsonl", ".npz", ".npy", ".bin", ".gz", ".zst"}


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.decode().split("\0") if p]


def _text(path: Path) -> str | None:
    if path.suffix in SKIP_SUFFIXES or not path.is_file():
        return None
    data = path.read_bytes()
    if b"\0" in data[:4096]:
        return None
    return data.decode("utf-8", errors="replace")


def find_history_words(text: str) -> list[str]:
    """The history phrases in ``text`` (what the tree test reports), in order."""
    return [m.group(0) for m in HISTORY_WORDS.finditer(text)]


def test_the_pattern_finds_history_and_spares_code_words() -> None:
    round_, issue = "sess" + "ion 9", "iss" + "ue #11"      # built here so this file has neither phrase
    found = find_history_words(
        f"measured in {round_}; see {issue} and (#12); the other helpers' jobs; a helperload run")
    assert found == [round_, issue, "(#12)", "other helpers'", "helperload"]
    assert find_history_words("a helper thread reads ahead; the helper function; a session token") == []


def test_no_tracked_file_speaks_of_work_rounds() -> None:
    me = Path(__file__).resolve()
    hits = []
    for path in _tracked():
        if path.resolve() == me:
            continue
        text = _text(path)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for word in find_history_words(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {word!r}")
    assert not hits, "history words in tracked files:\n" + "\n".join(hits[:50])


def test_no_log_files_are_tracked() -> None:
    logs = [str(p.relative_to(ROOT)) for p in _tracked() if p.suffix == ".log"]
    assert not logs, f"{len(logs)} committed log files, e.g. {logs[:5]}"
