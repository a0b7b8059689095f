#!/usr/bin/env bash
# The main job: installs what is missing, then streams an answer from the bundled default model
# with RACER on and prints the stats. Extra arguments go to `racer generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/racer generate "$@"
