#!/usr/bin/env bash
# Installs the dev environment (if needed) and runs the test suite: scripts/suite.py runs
# it in four pytest processes side by side, then the tests that need a quiet machine
# (flood, load, soak, the GPU check's windows) alone. Extra arguments
# go to pytest; with a path among them it is one plain pytest run, e.g.
# scripts/test.sh tests/unit -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh dev
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# keep compiled modules and pytest's rewritten asserts between runs (~7 s of each run)
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python scripts/suite.py "$@"
