#!/usr/bin/env bash
# The full test suite: lint and format checks (ruff), then pytest (the import contracts are one of
# its tests). Installs what is missing first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
