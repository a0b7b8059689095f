#!/usr/bin/env bash
# The main job: installs what is missing, starts drafter, verifier and gateway on localhost (three
# processes), streams an answer from the bundled default model through the gateway with RACER on,
# prints the stats and stops the services. Extra arguments go to `racer stack` (--keep: stay up).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/racer stack "$@"
