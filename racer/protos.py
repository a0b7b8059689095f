"""Regenerates the checked-in gRPC stubs (``common/v1``) from ``protos/``: ``python -m racer.protos``.

protoc names the generated modules after the proto files' paths (``racer/v1/*.proto`` ->
``common.v1.*_pb2``); the stubs live in the bottom package ``common``, so their imports of each other
are rewritten to relative ones (``from . import common_pb2``).

``python -m racer.protos --check`` builds them in a temporary directory and fails when the
checked-in files differ (a test runs it).
"""

from __future__ import annotations

import argparse
import filecmp
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "common" / "v1"
PACKAGE = Path("racer") / "v1"  # where the .proto files sit under protos/
_SIBLING_IMPORT = re.compile(r"^from racer\.v1 import ", re.M)


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / PACKAGE).glob("*.proto"))


def build(out: Path) -> list[str]:
    """Runs protoc and writes the stubs into ``out`` with relative imports; returns their names."""
    from grpc_tools import protoc

    include = str(resources.files("grpc_tools") / "_proto")
    files = [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{PROTO_DIR}",
                f"-I{include}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                *files,
            ]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with status {rc}")
        out.mkdir(parents=True, exist_ok=True)
        names = []
        for p in sorted((Path(tmp) / PACKAGE).iterdir()):
            if "_pb2" in p.name and p.suffix in (".py", ".pyi"):
                (out / p.name).write_text(_SIBLING_IMPORT.sub("from . import ", p.read_text()))
                names.append(p.name)
        return names


def stale() -> list[str]:
    """Generated files that are missing, extra or different in the checked-in tree."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = build(Path(tmp))
        have = sorted(p.name for p in OUT_DIR.iterdir() if "_pb2" in p.name and p.suffix in (".py", ".pyi"))
        bad = sorted(set(fresh) ^ set(have))
        bad += [p for p in fresh if p in have and not filecmp.cmp(Path(tmp) / p, OUT_DIR / p, shallow=False)]
        return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="fail if the checked-in stubs are stale")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for p in bad:
            print(f"stale: {p}", file=sys.stderr)
        return 1 if bad else 0
    for p in build(OUT_DIR):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
