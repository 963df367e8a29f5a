#!/usr/bin/env bash
# Builds the device kit: a wheelhouse of everything megascore and scripts/gpu_check.sh
# need beyond torch, for a CUDA host that has torch and no package index. Carry the
# checkout with DIR in it; scripts/gpu_check.sh installs from it (docs/deploy.md,
# "Checking a GPU host").
#
#   bash scripts/device_kit.sh [DIR] [--python X.Y]     # DIR: .whl (git-ignored)
#
# The list (scripts/device_kit.py): megascore's [server,cli] requirements and what the
# check runs (transformers, pytest, setuptools/wheel), closed over their requirements
# at the versions installed in the project venv, minus torch and torch's own. --python:
# the device's Python (default: the project venv's), x86-64 Linux wheels only. Fails
# when the kit and the working tree that travels with it exceed 64 MiB (what a device
# run carries at most).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.whl
TARGET=
while (($#)); do
  case "$1" in
    --python) TARGET=$2; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) DIR=$1; shift ;;
  esac
done
PY=${PYTHON:-.venv/bin/python}
TARGET=${TARGET:-$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')}

mapfile -t PINS < <("$PY" scripts/device_kit.py --python "$TARGET")
mkdir -p "$DIR"
rm -f "$DIR"/*.whl
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version "$TARGET" --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$DIR" "${PINS[@]}"
echo "device-kit: Python $TARGET"
"$PY" scripts/device_kit.py --size "$DIR"
