#!/usr/bin/env bash
# GPU check of megascore: prints a table (scripts/gpu_check.py lists the rows). One
# deadline (480 s) from this script's start, the kit install included: every row runs in
# what is left of its window and is written to $OUT (or --out DIR) as it finishes. On a
# machine without CUDA it prints the "no CUDA" table and exits 0; --device cpu runs the
# rows on the CPU. Exit status 1 when a row failed. --dry-run prints the plan only.
#
#   bash scripts/gpu_check.sh [--device auto|cuda|cpu] [--out DIR] [--rows a,b|all] [--dry-run]
#
# Python: $PYTHON, else .venv/bin/python, else python3. When that interpreter lacks
# megascore's dependencies or its installed entry points (`megascore serve` is found
# through the `megascore.commands` entry point), a venv .venv-gpu-check is made on top
# of it (it sees that interpreter's site directories after its own: the host's torch,
# CUDA and TransformerEngine stay) and filled offline from the device kit ($KIT, default .whl, made by
# scripts/device_kit.sh on a machine with PyPI), then megascore itself with
# `pip install --no-index --no-deps -e .`. The kit's wheels of what the host already has
# at an accepted version are left out (the host's numpy, transformers stay), and a host
# torch that megatron-core or megascore does not accept stops the install
# (scripts/kit_install.py).
set -uo pipefail
STARTED=$(date +%s.%N)  # the deadline counts from here

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3
fi
KIT=${KIT:-.whl}
READY='
import importlib.metadata as m, megatron.core, grpc_health.v1.health, transformers, pytest
import grpc_reflection.v1alpha.reflection, megascore_server, megascore_client
assert m.entry_points(group="megascore.commands", name="serve"), "no megascore.commands"
'

if [[ " $* " != *" --dry-run "* ]] && ! "$PY" -c "$READY" 2>/dev/null; then
  VENV="$ROOT/.venv-gpu-check"
  if ! compgen -G "$KIT/*.whl" >/dev/null; then
    echo "gpu_check: $PY lacks megascore's dependencies and $KIT holds no wheels:" \
      "run scripts/device_kit.sh on a machine with PyPI and carry $KIT" >&2
    exit 1
  fi
  echo "gpu_check: installing the kit ($(ls "$KIT"/*.whl | wc -l) wheels) and megascore" \
    "into $VENV" >&2
  rm -rf "$VENV"
  # A venv that also sees $PY's own site directories (a .pth after its own), so the
  # host's torch stays visible even when $PY is itself a venv's; pip is $PY's.
  "$PY" -m venv --without-pip "$VENV" || exit 1
  "$PY" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))' \
    >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/host_site.pth"
  PIP=("$PY" -m pip --python "$VENV/bin/python" install -q --disable-pip-version-check
       --no-index --find-links "$KIT" --no-deps)
  PLAN=$("$VENV/bin/python" scripts/kit_install.py "$KIT") || exit 1
  if [[ -n "$PLAN" ]]; then mapfile -t WHEELS <<<"$PLAN"; "${PIP[@]}" "${WHEELS[@]}" || exit 1; fi
  "${PIP[@]}" -e . || exit 1
  PY="$VENV/bin/python"
  "$PY" -c "$READY" || { echo "gpu_check: dependencies still missing" >&2; exit 1; }
fi
# This checkout first (an installed megascore may be another tree's), then tests/ helpers.
export PYTHONPATH="$ROOT/src:$ROOT/server:$ROOT/client:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
exec "$PY" scripts/gpu_check.py --started "$STARTED" "$@"
