#!/usr/bin/env bash
# The client and wire tests with every dependency at its declared floor (CI runs it):
# a venv (.venv-floors) holding the base dependencies, the server extra's light part
# (no torch, no megatron-core) and the cli extra, each pinned exactly to pyproject's
# ">=" bound (binary wheels only); megascore installed from this tree (non-editable, so
# the console script and entry points exist); then tests/client and tests/service.
# Tests that need torch skip themselves. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-floors
PINS=$("$PY" - <<'PYEOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
heavy = {"torch", "megatron-core"}  # the light server needs neither
extras = project["optional-dependencies"]
for spec in project["dependencies"] + extras["server"] + extras["cli"]:
    name, floor = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)(?:,.*)?", spec).groups()
    if name not in heavy:
        print(f"{name}=={floor}")
PYEOF
)
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# shellcheck disable=SC2086  # one pin per word
"$VENV/bin/pip" install -q --disable-pip-version-check --only-binary :all: $PINS \
  pytest pytest-timeout hypothesis cryptography
"$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall . && rm -rf build
echo "floors: $(echo $PINS)"
# Fails if pip resolved anything other than the floors.
"$VENV/bin/pip" check
"$VENV/bin/python" - "$PINS" <<'PYEOF'
import sys
from importlib.metadata import version
from packaging.version import Version
pins = [p.split("==") for p in sys.argv[1].split()]
wrong = [f"{n} {version(n)}" for n, floor in pins if Version(version(n)) != Version(floor)]
sys.exit(f"not at the floor: {wrong}" if wrong else 0)
PYEOF
# test_trl_grpo.py imports torch, trl and datasets at the top (the trl extra's test).
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  -W "ignore:datetime.datetime.utcnow:DeprecationWarning" tests/client tests/service \
  --ignore tests/client/test_trl_grpo.py "$@"
