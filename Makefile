# The two commands of the README.
.PHONY: setup train test test-slow test-gpu

setup:
	./scripts/setup.sh

# Trains the tiny GLM-5-style model on the Python standard library's source text (CPU, ~3 min).
train: setup
	.venv/bin/python examples/train.py --model glm5-tiny --steps 120 --metrics-out runs/train-metrics.json

# Two pytest workers (pytest-xdist): the suite is compile-bound, so one per core.
test: setup
	.venv/bin/python -m pytest -q -n 2 --dist worksteal tests

# The long tests that `make test` leaves out (pytest marker `slow`).
test-slow: setup
	.venv/bin/python -m pytest -q -n 2 --dist worksteal -m slow tests

# The GPU tests (pytest marker `gpu`: the CUDA kernels against float64 oracles at real model
# dims) on an SM90 machine, in one process (one GPU); `make test` skips them (137; 119 of them
# took 13.6 minutes on one H100); an error, not a pass, where no SM90 GPU or CUDA module is found.
test-gpu: setup
	.venv/bin/python -m pytest -q -m gpu tests
