#!/usr/bin/env bash
# The suite under coverage.py, every `megascore serve`, torchrun rank and other Python
# subprocess included (pyproject's [tool.coverage]: `patch = ["subprocess"]`, data saved
# on SIGTERM): prints line coverage of src/, server/ and client/ (docs/reliability.md
# "The suite"). It runs the suite as scripts/test.sh does (scripts/suite.py); extra
# arguments go to pytest; the suite's status is the script's.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh dev
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
unset PYTHONDONTWRITEBYTECODE  # as scripts/test.sh
data=$(mktemp -d)
trap 'rm -rf "$data"' EXIT
export COVERAGE_FILE=$data/coverage
status=0
.venv/bin/python -m coverage run scripts/suite.py "$@" || status=$?  # as scripts/test.sh
.venv/bin/python -m coverage combine -q
.venv/bin/python -m coverage report --format=total --precision=2 \
  | sed 's/^/line coverage of src, server, client: /; s/$/ %/'
.venv/bin/python -m coverage report --precision=2 | tail -1
exit "$status"
