#!/usr/bin/env bash
# Main job: starts `megascore serve` on the built-in tiny model (CPU), scores a
# sample batch through the client SDK, prints per-token logprobs and metrics,
# then stops the server with SIGTERM. Extra arguments go to `megascore serve`
# (e.g. `bash scripts/demo.sh --model tiny-moe --nproc 2 --tensor-model-parallel-size 2`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh server,cli
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
# A free port below the ephemeral range, so no other process's bind(0) takes it
# while the server imports torch.
port=$(.venv/bin/python -c 'from megascore_server.ports import pick_port; print(pick_port())')
log=$(mktemp "${TMPDIR:-/tmp}/megascore-demo.XXXXXX.log")
echo "starting megascore serve on 127.0.0.1:$port (server log: $log)"
.venv/bin/megascore serve --host 127.0.0.1 --port "$port" "$@" >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
# The client stops waiting (exit 1, log tail) as soon as the server process dies.
.venv/bin/python scripts/demo_client.py --target "127.0.0.1:$port" \
  --server-pid "$server" --server-log "$log"
kill -TERM "$server"
status=0
wait "$server" || status=$?
trap - EXIT
echo "server stopped (exit $status; log: $log)"
