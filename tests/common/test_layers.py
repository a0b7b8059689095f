"""The import contracts in pyproject.toml (import-linter): the application over the services over
common, no service importing another, no grpc or protobuf in the services' cores, no circle among
the verifier's modules, nothing importing the benchmarks."""

from __future__ import annotations

import ast
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


def imports_from_tests(source: str) -> list[str]:
    """The modules under ``tests`` a script's source imports."""
    out = []
    for node in ast.walk(ast.parse(source)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        out += [n for n in names if n == "tests" or n.startswith("tests.")]
    return out


def test_scripts_import_nothing_from_the_tests():
    """What a script needs of the tests' helpers lives in the packages (racer/bench/), the tests
    re-use it from there."""
    found = {p.name: imports_from_tests(p.read_text()) for p in sorted((ROOT / "scripts").glob("*.py"))}
    assert not {k: v for k, v in found.items() if v}


def test_an_import_from_the_tests_is_caught():
    source = "import os\nfrom tests.support.engine import hf_greedy\ndef f():\n    import tests.support.stack\n"
    assert imports_from_tests(source) == ["tests.support.engine", "tests.support.stack"]
