"""Regenerates the checked-in gRPC stubs (``racer/v1``) from ``protos/``: ``python -m racer.protos``.

``python -m racer.protos --check`` builds them in a temporary directory and fails when the
checked-in files differ (a test runs it).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT  # package racer.v1 -> racer/v1/*_pb2*.py
PACKAGE = Path("racer") / "v1"


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / PACKAGE).glob("*.proto"))


def build(out: Path) -> list[Path]:
    """Runs protoc into ``out``; returns the generated files relative to ``out``."""
    from grpc_tools import protoc

    include = str(resources.files("grpc_tools") / "_proto")
    files = [str(p.relative_to(PROTO_DIR)) for p in proto_files()]
    (out / PACKAGE).mkdir(parents=True, exist_ok=True)
    rc = protoc.main(
        ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}",
         f"--grpc_python_out={out}", *files]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with status {rc}")
    return sorted(p.relative_to(out) for p in (out / PACKAGE).iterdir() if p.name.endswith((".py", ".pyi")) and "_pb2" in p.name)


def stale() -> list[str]:
    """Generated files that are missing, extra or different in the checked-in tree."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = build(Path(tmp))
        have = sorted(p.relative_to(OUT_DIR) for p in (OUT_DIR / PACKAGE).iterdir() if "_pb2" in p.name and p.suffix in (".py", ".pyi"))
        bad = [str(p) for p in sorted(set(fresh) ^ set(have))]
        bad += [str(p) for p in fresh if p in have and not filecmp.cmp(Path(tmp) / p, OUT_DIR / p, shallow=False)]
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
