"""The import contracts in pyproject.toml (import-linter): the application over the services over
common, no service importing another, no grpc or protobuf in the services' cores, no circle among
the verifier's modules, nothing importing the benchmarks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("common", "drafter", "verifier", "gateway", "racer")


def lint_imports(cwd: Path, contract: str | None = None) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "lint-imports"
    only = ["--contract", contract] if contract else []
    return subprocess.run([str(exe), "--no-cache", *only], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_packages_keep_their_layers():
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize(
    ("path", "line", "contract", "edge"),
    [
        ("common/params.py", "import racer.cli", "layers", "common.params -> racer.cli"),  # upward
        ("verifier/tree.py", "import drafter.tree", "layers", "verifier.tree -> drafter.tree"),  # sideways
        ("drafter/automaton.py", "import grpc", "cores", "drafter.automaton -> grpc"),  # grpc in a core
        ("gateway/turn.py", "import common.v1.generation_pb2", "cores", "gateway.turn -> common.v1.generation_pb2"),
        ("gateway/core.py", "import aiohttp.web", "cores", "gateway.core -> aiohttp"),  # HTTP in a core
        ("verifier/tree.py", "import verifier.engine", "verifier-acyclic", ".tree -> .engine"),  # a circle
        ("racer/stack.py", "import racer.bench.modes", "bench-apart", "racer.stack -> racer.bench.modes"),
    ],
)
def test_the_contracts_catch_a_bad_import(tmp_path, path, line, contract, edge):
    """The same contracts over a copy of the packages with one bad import added."""
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / path, "a") as f:
        f.write(f"\n{line}  # noqa\n")
    run = lint_imports(tmp_path, contract)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "1 broken" in out and edge in out, out
