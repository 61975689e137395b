#!/usr/bin/env bash
# Set everything up on a fresh machine and run the whole test suite (slow tests included).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/lint-imports --no-cache --no-logo  # the layers hold ([tool.importlinter] in pyproject.toml)
.venv/bin/mypy                               # the package type-checks ([tool.mypy] in pyproject.toml)
.venv/bin/kvbaton model pull >/dev/null
# Two pytest-xdist workers: the end-to-end tests one after another on one, every other module on either
# (tests/README.md, "Parallel"). KVBATON_TEST_WORKERS=0 runs everything in one process.
workers=${KVBATON_TEST_WORKERS:-2}
if [ "$workers" = 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
exec .venv/bin/python -m pytest -q -n "$workers" "$@"  # scheduled by tests/conftest.py
