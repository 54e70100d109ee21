"""The user-facing docs stay true: docs/operations.md lists every metric kvtier exports, the README
keeps its newcomer's path short and names the two fresh-machine commands, and every relative link in
the docs path points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import REGISTRY

import kvtier.integrations.vllm.metrics  # noqa: F401  (registers the connector's metrics)
import kvtier.metrics  # noqa: F401  (registers the store's metrics)

ROOT = Path(__file__).resolve().parents[2]
PATH_PAGES = ["README.md", "docs/index.md", "docs/quickstart.md", "docs/deployment.md",
              "docs/operations.md", "docs/troubleshooting.md"]


def _kvtier_metric_names() -> set[str]:
    names = set()
    for family in REGISTRY.collect():
        if family.name.startswith("kvtier_"):
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_operations_lists_every_metric():
    text = (ROOT / "docs" / "operations.md").read_text()
    names = _kvtier_metric_names()
    assert len(names) >= 25
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert missing == [], f"add these metrics to docs/operations.md: {missing}"


def test_readme_is_short_and_names_the_fresh_machine_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.split()) <= 1050
    for cmd in ("make demo", "make test", "make test-unit", "pip install", "kvtier serve"):
        assert cmd in text, cmd


def test_relative_links_of_the_docs_path_exist():
    broken = []
    for page in PATH_PAGES:
        path = ROOT / page
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if target.startswith(("http://", "https://")):
                continue
            if not (path.parent / target).exists():
                broken.append(f"{page}: {target}")
    assert broken == []
