# The two set-up commands of the README. Both create .venv and install what they need.
.PHONY: demo test install
demo:
	bash scripts/bootstrap.sh demo
test:
	bash scripts/bootstrap.sh test
install:
	bash scripts/bootstrap.sh install
