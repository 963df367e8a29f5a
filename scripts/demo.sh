#!/usr/bin/env bash
# Main job: starts `megascore serve` on the built-in tiny model (CPU), scores a
# sample batch through the client SDK, prints per-token logprobs and metrics,
# then stops the server with SIGTERM. Extra arguments go to `megascore serve`
# (e.g. `bash scripts/demo.sh --model tiny-moe --nproc 2 --tensor-model-parallel-size 2`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh server,cli
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
.venv/bin/megascore serve --host 127.0.0.1 --port "$port" "$@" &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
.venv/bin/python scripts/demo_client.py --target "127.0.0.1:$port"
kill -TERM "$server"
wait "$server"
status=$?
trap - EXIT
echo "server stopped (exit $status)"
