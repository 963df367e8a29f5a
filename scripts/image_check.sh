#!/usr/bin/env bash
# Builds the CPU image (docker/Dockerfile.cpu), runs it and checks it from the outside:
# the container's HEALTHCHECK turns healthy, the SDK on this host scores through the
# published port and the HTTP front (--http-port 8000) answers the same logprobs, the server runs as UID 10001, and SIGTERM drains (in-flight calls
# finish, new ones are refused, exit status 0). Last line:
#   image-check: built <tag> <size>, scored N sequences (HTTP front: equal), exit 0
#
#   bash scripts/image_check.sh [--keep]        # --keep: leave the image (else removed)
#
# Engine: docker where a daemon answers, else podman (installed with runc and
# debootstrap from Debian's packages when absent; needs root, idempotent), run with
# runc, cgroupfs and no default ulimits (CONTAINERS_CONF, a file of this run).
# Base: $BASE, else a local Debian trixie base (Python 3.13) made with
# `debootstrap --variant=minbase` from this host's Debian mirror and imported once
# (localhost/megascore-base:trixie), trusting this host's CA bundle. torch: the PyTorch
# CPU index when it answers, else PyPI's (CUDA) torch; $TORCH_INDEX overrides.
# Host side: $PYTHON (default .venv/bin/python) with this checkout on PYTHONPATH.
# Measured build times: docs/deploy.md ("Images, built and run").
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
KEEP=0
[[ "${1:-}" == "--keep" ]] && KEEP=1
PY=${PYTHON:-.venv/bin/python}
TAG=${IMAGE_TAG:-localhost/megascore:cpu-check}
GPU_TAG=localhost/megascore:gpu-check
TORCH_TAG=localhost/megascore-torch:check
NGC_TAG=localhost/megascore-ngc-like:check
NGC_PROTOBUF=4.25.8 NGC_GRPCIO=1.66.2  # the stand-in constraints (wheels for cp312 and cp313)
NAME=megascore-image-check-$$
BASE_TAG=localhost/megascore-base:trixie
CPU_INDEX=$(sed -n 's/^ARG TORCH_INDEX=//p' docker/Dockerfile.cpu)
WORK=$(mktemp -d /tmp/image_check.XXXX)
log() { echo "image-check: $*" >&2; }

if docker info >/dev/null 2>&1; then
  ENGINE=(docker)
else
  if ! command -v podman >/dev/null || ! command -v runc >/dev/null \
     || ! command -v debootstrap >/dev/null; then
    log "installing podman, runc, debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      podman runc debootstrap >/dev/null
  fi
  cat >"$WORK/containers.conf" <<'CONF'
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
CONF
  export CONTAINERS_CONF=$WORK/containers.conf
  ENGINE=(podman)
fi
cleanup() {
  "${ENGINE[@]}" rm -f "$NAME" >/dev/null 2>&1 || true
  ((KEEP)) || "${ENGINE[@]}" rmi -f "$TAG" "$GPU_TAG" "$NGC_TAG" "$TORCH_TAG" >/dev/null 2>&1 \
    || true
  rm -rf "$WORK"
}
trap cleanup EXIT

build_args=()
if [[ -n "${BASE:-}" ]]; then
  build_args+=(--build-arg "BASE=$BASE")
else
  if ! "${ENGINE[@]}" image inspect "$BASE_TAG" >/dev/null 2>&1; then
    mirror=${MIRROR:-$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources \
      2>/dev/null || true)}
    mirror=${mirror:-$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list)}
    log "making $BASE_TAG with debootstrap from $mirror"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
      trixie "$WORK/rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
      || { tail -5 "$WORK/debootstrap.log" >&2; exit 1; }
    cp /etc/ssl/certs/ca-certificates.crt "$WORK/rootfs/etc/ssl/certs/ca-certificates.crt"
    tar -C "$WORK/rootfs" -c . | "${ENGINE[@]}" import - "$BASE_TAG" >/dev/null
    rm -rf "$WORK/rootfs"
  fi
  build_args+=(--build-arg "BASE=$BASE_TAG")
fi
if [[ -z "${TORCH_INDEX:-}" ]] && ! curl -fsS -m 20 -o /dev/null "$CPU_INDEX/torch/"; then
  TORCH_INDEX=$("$PY" -c 'from pip._internal.models.index import PyPI; print(PyPI.simple_url)')
  log "$CPU_INDEX does not answer: torch from $TORCH_INDEX (the CUDA build)"
fi
[[ -n "${TORCH_INDEX:-}" ]] && build_args+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
fmt=()
[[ ${ENGINE[0]} == podman ]] && fmt=(--format docker)  # keeps HEALTHCHECK


build() {  # build TAG ARGS...: the image, its size on stdout
  local tag=$1 t=$SECONDS
  shift
  "${ENGINE[@]}" build --network host "${fmt[@]}" "$@" -t "$tag" >"$WORK/build.log" 2>&1 \
    || { tail -20 "$WORK/build.log" >&2; exit 1; }
  log "built $tag in $((SECONDS - t)) s"
  "${ENGINE[@]}" image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.2fGB", $1 / 1e9}'
}
health() {
  if [[ ${ENGINE[0]} == podman ]]; then
    podman healthcheck run "$NAME" >/dev/null 2>&1 && echo healthy
  else
    docker inspect --format '{{.State.Health.Status}}' "$NAME"
  fi
}
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
check() {  # check TAG SIZE SERVE-ARGS...: run, health, user, SDK + HTTP scoring, SIGTERM drain
  local tag=$1 size=$2 port http_port deadline uid procs summary code
  shift 2
  port=$(free_port)
  http_port=$(free_port)
  # podman without systemd cannot add the health check's timer: it is run on demand here.
  "${ENGINE[@]}" run -d --name "$NAME" -p "127.0.0.1:$port:50051" \
    -p "127.0.0.1:$http_port:8000" "$tag" "$@" --http-port 8000 \
    >"$WORK/run.log" 2>&1 || { cat "$WORK/run.log" >&2; exit 1; }
  deadline=$((SECONDS + 300))
  until [[ "$(health)" == healthy ]]; do
    if ((SECONDS > deadline)) \
       || [[ "$("${ENGINE[@]}" inspect --format '{{.State.Running}}' "$NAME")" != true ]]; then
      "${ENGINE[@]}" logs "$NAME" 2>&1 | tail -20 >&2
      log "$tag never turned healthy"; exit 1
    fi
    sleep 2
  done
  log "$tag healthy after $((SECONDS - deadline + 300)) s"
  uid=$("${ENGINE[@]}" exec "$NAME" id -u)
  procs=$("${ENGINE[@]}" top "$NAME" user | awk 'NR > 1 {print $1}' | sort -u | xargs)
  [[ "$uid" == 10001 && ("$procs" == 10001 || "$procs" == megascore) ]] \
    || { log "$tag runs as UID $uid, processes as $procs: not 10001"; exit 1; }
  summary=$(PYTHONPATH="$ROOT/src:$ROOT/client" "$PY" scripts/image_check_client.py \
    --target "127.0.0.1:$port" --http "http://127.0.0.1:$http_port" --stop-command "${ENGINE[*]} kill --signal TERM $NAME")
  code=$("${ENGINE[@]}" wait "$NAME")
  if [[ "$code" != 0 ]]; then
    "${ENGINE[@]}" logs "$NAME" 2>&1 | tail -20 >&2
    log "$tag exited $code after SIGTERM"; exit 1
  fi
  "${ENGINE[@]}" rm -f "$NAME" >/dev/null
  log "$tag: user $uid; drain $summary"
  echo "image-check: built $tag $size, scored $(summary_field "$summary" scored) sequences" \
    "(HTTP front: $(summary_field "$summary" http)), exit $code"
}
summary_field() { "$PY" -c 'import json, sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$@"; }

# The CPU image.
size=$(build "$TAG" -f docker/Dockerfile.cpu "${build_args[@]}" .)
cpu_line=$(check "$TAG" "$size" --model tiny)

# The GPU image (docker/Dockerfile) on a stand-in for the NGC base: the CPU image's
# "torch" stage plus a pip constraint file pinning torch, protobuf and grpcio as NGC
# pins its own (older than PyPI's newest). Its install step must keep all three.
pins=("torch==$(sed -n 's/^ARG TORCH_VERSION=//p' docker/Dockerfile.cpu)"
      "protobuf==$NGC_PROTOBUF" "grpcio==$NGC_GRPCIO")
build "$TORCH_TAG" -f docker/Dockerfile.cpu "${build_args[@]}" --target torch . >/dev/null
cat >"$WORK/Containerfile.ngc" <<NGC
FROM $TORCH_TAG
RUN mkdir -p /etc/pip && printf '%s\n' ${pins[*]} >/etc/pip/constraint.txt
ENV PIP_CONSTRAINT=/etc/pip/constraint.txt
NGC
build "$NGC_TAG" -f "$WORK/Containerfile.ngc" "$WORK" >/dev/null
gpu_size=$(build "$GPU_TAG" -f docker/Dockerfile --build-arg "BASE=$NGC_TAG" .)
kept=$("${ENGINE[@]}" run --rm --entrypoint python "$GPU_TAG" -c \
  'from importlib.metadata import version as v; print(*(f"{p}=={v(p).split("+")[0]}" for p in ("torch", "protobuf", "grpcio")))')
[[ "$kept" == "${pins[*]}" ]] || { log "GPU image: $kept, not the constraints ${pins[*]}"; exit 1; }
log "GPU image kept the constraints: $kept"
check "$GPU_TAG" "$gpu_size" --model tiny --device cpu --dtype float32
echo "$cpu_line"
