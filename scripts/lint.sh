#!/usr/bin/env bash
# Lint and format checks: ruff (Python) and clang-format (C++/CUDA), as configured in ruff.toml
# and .clang-format. `bash scripts/lint.sh --fix` applies the formatting instead of checking it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "ruff==0.17.6" "clang-format==23.1.5"
cxx=$(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' 'tools/*.cu')
if [ "${1:-}" = "--fix" ]; then
  python -m ruff check --fix .
  python -m ruff format .
  clang-format -i $cxx
  exit 0
fi
python -m ruff check .
python -m ruff format --check .
clang-format --dry-run -Werror $cxx
echo "lint: ok"
