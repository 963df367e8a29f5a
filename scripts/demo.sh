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
port=$(.venv/bin/python - <<'PY'
import random, socket
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for port in random.sample(range(20000, low), 200):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
        print(port)
        break
PY
)
.venv/bin/megascore serve --host 127.0.0.1 --port "$port" "$@" &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
.venv/bin/python scripts/demo_client.py --target "127.0.0.1:$port"
kill -TERM "$server"
wait "$server"
status=$?
trap - EXIT
echo "server stopped (exit $status)"
