#!/usr/bin/env bash
# Set up an isolated venv with Arize Phoenix (`phoenix serve`) for tests/test_phoenix.py.
#
#   bash scripts/setup_phoenix.sh                 # creates/updates ./.venv-phoenix
#   PHOENIX_VENV=/some/path bash scripts/setup_phoenix.sh
#   PHOENIX_BIN=$PWD/.venv-phoenix/bin/phoenix python -m pytest tests/test_phoenix.py
#
# Why a venv of its own: arize-phoenix needs graphql-core 3.3, and MLflow's /graphql (graphene 3)
# needs graphql-core < 3.3, so the two cannot share the main venv. The test itself runs in the
# main venv (the tracer and Phoenix's small client, arize-phoenix-client, from the test extra)
# and only starts the server from here.
#
# Idempotent: a stamp file records what was installed; a rerun with the same pin only checks
# that the package and its `phoenix` command are there (a second). PHOENIX_SETUP_FORCE=1
# reinstalls. A fresh install took 621-654 s on a 2-core machine at load ~14 (853 MB).
set -euo pipefail

SECONDS=0
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${PHOENIX_VENV:-$REPO_ROOT/.venv-phoenix}"
PYTHON="${PYTHON:-python3}"
PHOENIX_VERSION="${PHOENIX_VERSION:-20.26.1}"
STAMP_CONTENT="arize-phoenix==${PHOENIX_VERSION}"
STAMP="$VENV/.rollout-tracer-phoenix-stamp"

log() { printf '[setup_phoenix %4ss] %s\n' "$SECONDS" "$*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_run() {  # minus this machine kind's noise about local index pages that do not exist
    "$PY" -m pip --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [[ "${PHOENIX_SETUP_FORCE:-0}" != "1" && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_CONTENT" ]] \
        && [[ -x "$VENV/bin/phoenix" ]] \
        && "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('phoenix') is None)"; then
    log "arize-phoenix==$PHOENIX_VERSION already installed (stamp matches)"
else
    rm -f "$STAMP"
    log "installing arize-phoenix==$PHOENIX_VERSION"
    pip_run install -q "arize-phoenix==$PHOENIX_VERSION"
    "$PY" -c "import phoenix.server.main" || { log "ERROR: phoenix does not import"; exit 1; }
    echo "$STAMP_CONTENT" >"$STAMP"
fi
log "venv size: $(du -sh "$VENV" 2>/dev/null | cut -f1); total ${SECONDS}s"
log "server: $VENV/bin/phoenix"
