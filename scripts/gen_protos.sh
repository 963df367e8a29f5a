#!/usr/bin/env bash
# Regenerates the checked-in gRPC stubs under src/ from protos/.
# The include root mirrors the package, so generated imports need no fix-up.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
"$PY" -m grpc_tools.protoc -Iprotos --python_out=src --grpc_python_out=src --pyi_out=src \
  protos/megascore/v1/*.proto
