"""The import contracts in pyproject.toml (import-linter): the application over the services over
common, no service importing another, no grpc or protobuf in the services' cores."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "drafter", "verifier", "gateway", "racer")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "lint-imports"
    return subprocess.run([str(exe), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_packages_keep_their_layers():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_contracts_catch_upward_sideways_and_grpc_imports(tmp_path):
    """The same contracts over a copy with three bad imports added: each one breaks a contract."""
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    bad = {
        "common/params.py": ("import racer.cli", "common.params -> racer.cli"),  # upward
        "verifier/tree.py": ("import drafter.tree", "verifier.tree -> drafter.tree"),  # sideways
        "drafter/automaton.py": ("import grpc", "drafter.automaton -> grpc"),  # grpc in a core
    }
    for path, (line, _) in bad.items():
        with open(tmp_path / path, "a") as f:
            f.write(f"\n{line}  # noqa\n")
    run = lint_imports(tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode != 0
    assert "2 broken" in out, out
    for _, (_, edge) in bad.items():
        assert edge in out, (edge, out)
