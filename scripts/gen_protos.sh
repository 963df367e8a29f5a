#!/usr/bin/env bash
# Regenerates the checked-in gRPC stubs under src/ from protos/.
# The include root mirrors the package, so generated imports need no fix-up.
#
# The generator is pinned, in its own venv (.venv-protoc), because the generated code
# carries the oldest protobuf/grpcio it imports with: grpcio-tools 1.62 emits protobuf
# 4.25 gencode without a runtime-version check and stubs without a grpcio-version check,
# so the stubs import with every protobuf >= 4.21.6 and grpcio >= 1.59 (pyproject's
# floors, run by .ci/run's minimum-versions job). Newer grpcio-tools would raise those
# floors to its own release (docs/deploy.md, "Dependency floors").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TOOLS=grpcio-tools==1.62.3
VENV=.venv-protoc
if [ "$(cat "$VENV/.tools" 2>/dev/null)" != "$TOOLS" ]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check "$TOOLS"
  echo "$TOOLS" >"$VENV/.tools"
fi
"$VENV/bin/python" -m grpc_tools.protoc -Iprotos --python_out=src --grpc_python_out=src \
  --pyi_out=src protos/megascore/v1/*.proto
