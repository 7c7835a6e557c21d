# The two commands of the README.
.PHONY: setup train test

setup:
	./scripts/setup.sh

# Trains the tiny GLM-5-style model on the Python standard library's source text (CPU, ~3 min).
train: setup
	.venv/bin/python examples/train.py --model glm5-tiny --steps 120 --metrics-out runs/train-metrics.json

test: setup
	.venv/bin/python -m pytest -q tests
