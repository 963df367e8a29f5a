#!/usr/bin/env bash
# One-shot GPU check of megascore: prints a table (versions, HAVE_TE / HAVE_BRIDGE,
# tests/gpu, the CUDA engine in bf16, `megascore serve --device cuda` with the CLI, an
# HF -> Megatron checkpoint round trip served with each backend, bench/mfu.py). About
# 5 minutes on one GPU; on a machine without CUDA it prints the "no CUDA" table and
# exits 0. Exit status 1 when a check failed. Details: scripts/gpu_check.py.
#
#   bash scripts/gpu_check.sh [--device auto|cuda|cpu] [--out DIR]
#   bash scripts/gpu_check.sh --download-wheels   # on a machine with PyPI, before going
#
# Python: $PYTHON, else .venv/bin/python, else python3; megascore runs from this
# checkout (PYTHONPATH). Missing dependencies (megatron-core, the gRPC health /
# reflection services) come from wheels in .whl/ (git-ignored; made by
# --download-wheels for a cp312 x86-64 Linux machine) when the machine has no registry,
# else from PyPI; either way into a throw-away target directory, never the system site.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3
fi
WHEELS=(megatron-core==0.19.2 grpcio==1.85.3 grpcio-health-checking==1.85.1
        grpcio-reflection==1.85.1 protobuf==7.36.2)
NEEDED="import megatron.core, grpc_health.v1.health, grpc_reflection.v1alpha.reflection"

if [[ "${1:-}" == "--download-wheels" ]]; then
  for spec in "${WHEELS[@]}"; do
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
      -d .whl "$spec" || exit 1
  done
  ls -l .whl
  exit 0
fi

export PYTHONPATH="$ROOT/src:$ROOT/server:$ROOT/client:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
if ! "$PY" -c "$NEEDED" 2>/dev/null; then
  SITE="$(mktemp -d /tmp/megascore_site.XXXX)"
  if compgen -G ".whl/*.whl" >/dev/null; then
    echo "gpu_check: installing $(ls .whl | wc -l) carried wheels into $SITE" >&2
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl || exit 1
  else
    echo "gpu_check: installing ${WHEELS[*]} from the registry into $SITE" >&2
    "$PY" -m pip install -q --no-deps --no-cache-dir --target "$SITE" "${WHEELS[@]}" || exit 1
  fi
  export PYTHONPATH="$PYTHONPATH:$SITE"
  "$PY" -c "$NEEDED" || { echo "gpu_check: dependencies still missing" >&2; exit 1; }
fi
exec "$PY" scripts/gpu_check.py "$@"
