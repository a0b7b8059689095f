"""The docs name only paths, source files and Python names that exist: a renamed or deleted module,
function or class cannot stay behind in them.

CHANGELOG.md is not read: naming what a path was is its job; nor is a name the docs give as what
something was ("formerly `failover.py`")."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("common/", "drafter/", "verifier/", "gateway/", "racer/", "tests/", "scripts/", "k8s/", "protos/", "docs/")
CODE = re.compile(r"`([^`\s]+)`")
PACKAGES = ("common", "drafter", "verifier", "gateway", "racer")
SOURCE = re.compile(r"[A-Za-z0-9_]+\.(?:py|c|h|sh)")  # a file named alone: `procs.py`
DOTTED = re.compile(r"(?:%s)(?:\.[A-Za-z_][A-Za-z0-9_]*){2,}" % "|".join(PACKAGES))  # `racer.stack.running`
WAS = re.compile(r"\b(?:formerly|was|were|earlier|old)\b")


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


def spans(text: str):
    """Each inline code span's text, unless the words before it (back to the previous span) say it
    is what something was."""
    end = 0
    for m in CODE.finditer(text):
        before, end = text[end : m.start()], m.end()
        if not WAS.search(before):
            yield m.group(1).rstrip(".,:;)")


def named_files(text: str) -> set[str]:
    """Source files named alone (no directory): ``procs.py``, ``native_attention.c``."""
    return {p for p in spans(text) if SOURCE.fullmatch(p)}


def named_objects(text: str) -> set[str]:
    """Python names written from their package down: ``common.loop.DraftPort``,
    ``racer.launch.start_gateway`` (the protocol's ``racer.v1.*`` is no module)."""
    return {p for p in spans(text) if DOTTED.fullmatch(p) and not p.startswith("racer.v1.")}


@functools.cache
def repository_files() -> frozenset[str]:
    roots = [ROOT / t.rstrip("/") for t in TOP]
    return frozenset(p.name for r in roots if r.exists() for p in r.rglob("*") if "__pycache__" not in p.parts)


def _names(body) -> dict[str, ast.AST]:
    """What a module's or class's body defines, by name (imports included: they are its names too)."""
    out = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            out.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            out.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
    return out


def resolves(dotted: str, root: Path = ROOT) -> bool:
    """The longest module prefix of ``dotted`` is a file, its next name is defined in it and, when
    that is a class, the name after it in the class (attributes further down are not followed)."""
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 1, -1):
        base = root.joinpath(*parts[:i])
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.exists():
                rest, scope = parts[i:], _names(ast.parse(path.read_text()).body)
                node = scope.get(rest[0])
                if node is None:
                    return False
                return len(rest) == 1 or not isinstance(node, ast.ClassDef) or rest[1] in _names(node.body)
    return False


def test_every_source_file_the_docs_name_alone_exists():
    missing = [(d.name, f) for d in docs() for f in sorted(named_files(d.read_text())) if f not in repository_files()]
    assert not missing, f"docs name source files that do not exist: {missing}"


def test_every_python_name_the_docs_name_exists():
    missing = [(d.name, o) for d in docs() for o in sorted(named_objects(d.read_text())) if not resolves(o)]
    assert not missing, f"docs name modules, functions or classes that do not exist: {missing}"


def test_a_stale_file_or_name_is_caught():
    text = "`procs.py`, `bench_corpus_stack.py` (formerly `bench.py`); `racer.stack.running`, `racer.load.main`"
    assert named_files(text) == {"procs.py", "bench_corpus_stack.py"}
    assert "bench_corpus_stack.py" not in repository_files() and "procs.py" in repository_files()
    assert named_objects(text + ", `racer.v1.Verifier`") == {"racer.stack.running", "racer.load.main"}
    assert resolves("racer.stack.running") and resolves("common.session_stream.SessionStream")
    assert resolves("verifier.backend.Backend.prefix_exact")
    assert not resolves("racer.load.main") and not resolves("racer.stack.sprint")
    assert not resolves("verifier.backend.Backend.no_such_method")


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
