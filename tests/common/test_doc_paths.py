"""The docs name only paths that exist: a renamed or deleted module cannot stay behind in them.

CHANGELOG.md is not read: naming what a path was is its job."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("common/", "drafter/", "verifier/", "gateway/", "racer/", "tests/", "scripts/", "k8s/", "protos/", "docs/")
CODE = re.compile(r"`([^`\s]+)`")


def docs() -> list[Path]:
    pages = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("**/*.md"))]
    return [p for p in pages if p.resolve() != ROOT / "CHANGELOG.md"]


def named_paths(text: str) -> set[str]:
    """Repository paths in inline code: ``verifier/load.py``, ``k8s/components/saturation``;
    globs, placeholders and ``path:line`` forms are cut to what can be checked."""
    out = set()
    for m in CODE.finditer(text):
        p = m.group(1).rstrip(".,:;)")
        if "://" in p or any(c in p for c in "*<>{}$=[") or not p.startswith(TOP):
            continue
        out.add(p.split(":")[0])
    return out


def test_every_path_the_docs_name_exists():
    missing = [
        (d.name, p) for d in docs() if d.exists() for p in sorted(named_paths(d.read_text())) if not (ROOT / p).exists()
    ]
    assert not missing, f"docs name paths that do not exist: {missing}"


def test_a_stale_path_is_caught():
    assert named_paths("see `gateway/failover.py` and `k8s/components/autoscaling`, not `http://x/y`") == {
        "gateway/failover.py",
        "k8s/components/autoscaling",
    }
    assert not (ROOT / "gateway/failover.py").exists()
