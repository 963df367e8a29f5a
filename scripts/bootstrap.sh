#!/usr/bin/env bash
# Creates .venv with Python 3.12 and installs megascore with the given extras.
# Usage: scripts/bootstrap.sh EXTRAS   (e.g. "server,cli" or "dev")
# Idempotent: re-installs only when pyproject.toml or the extras changed.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${1:-dev}
venv=${MEGASCORE_VENV:-.venv}

find_python() {
  for cand in "${MEGASCORE_PYTHON:-}" python3.12; do
    [ -n "$cand" ] || continue
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; assert sys.version_info[:2] >= (3, 12)' 2>/dev/null; then
      echo "$cand"; return
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare | grep -E '^3\.1[2-9]' | sort -V); do  # oldest supported first: 3.12 is what the NGC images run
      echo "$(pyenv root)/versions/$v/bin/python3"; return
    done
  fi
  echo "error: megascore needs Python >= 3.12 (set MEGASCORE_PYTHON)" >&2
  exit 1
}

if [ ! -x "$venv/bin/python" ]; then
  py=$(find_python)
  echo "creating $venv with $py" >&2
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
fi

stamp="$venv/.megascore-installed"
want="$(sha256sum pyproject.toml | cut -c1-16) $extras"
if [ ! -f "$stamp" ] || ! grep -qxF "$want" "$stamp"; then
  echo "installing megascore[$extras] into $venv (first run downloads torch, a few minutes)" >&2
  log="$venv/install.log"
  if ! "$venv/bin/python" -m pip install -q -e ".[$extras]" >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    echo "error: pip install failed (full log: $log)" >&2
    exit 1
  fi
  echo "$want" >> "$stamp"
fi
