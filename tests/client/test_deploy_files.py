"""Static checks of the deployment files (no Docker engine or cluster needed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megascore_client.cli import main
from tests.client.fake_server import VOCAB, FakeServer

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
yaml = pytest.importorskip("yaml")


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


def test_dockerfiles_pass_hadolint():
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip("hadolint not installed")
    files = [str(DOCKER / "Dockerfile"), str(DOCKER / "Dockerfile.cpu")]
    proc = subprocess.run([hadolint, *files], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_shape(name):
    text = (DOCKER / name).read_text()
    assert 'ENTRYPOINT ["megascore", "serve"]' in text and "EXPOSE 50051" in text
    assert "MEGASCORE_HOST=0.0.0.0" in text and "USER 10001" in text
    assert "HEALTHCHECK" in text and '"megascore", "health"' in text
    ignore = (DOCKER / f"{name}.dockerignore").read_text().splitlines()
    assert ignore[-1] != "" and "!client/" in ignore and "!server/" in ignore


def test_gpu_image_keeps_float32_gemms_out_of_tf32():
    """The NGC base sets TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 (TF32 for every float32 GEMM,
    whatever torch's flags); the image's own ENV, after FROM, sets it back to 0."""
    text = (DOCKER / "Dockerfile").read_text()
    after_from = text[text.index("\nFROM ") :]
    env = after_from[
        after_from.index("\nENV ") : after_from.index("\n\n", after_from.index("\nENV "))
    ]
    assert "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=0 \\" in env


def test_compose_smoke_service_waits_for_a_healthy_server():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    server, smoke = compose["services"]["server"], compose["services"]["smoke"]
    assert server["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    assert server["healthcheck"]["test"][1:3] == ["megascore", "health"]
    assert smoke["depends_on"]["server"]["condition"] == "service_healthy"
    script = smoke["command"][0]
    assert "megascore health" in script and "megascore score /examples/smoke.jsonl" in script
    for path in ("smoke.jsonl", "rl_rollout_scoring.py"):
        assert (ROOT / "examples" / path).exists()


def test_smoke_file_scores(tmp_path, capsys):
    rows = [json.loads(line) for line in (ROOT / "examples/smoke.jsonl").read_text().splitlines()]
    ids = [i for r in rows for i in (r if isinstance(r, list) else r["token_ids"])]
    assert max(ids) < VOCAB  # valid for the built-in tiny model (vocab 512) too
    with FakeServer() as srv:
        out = tmp_path / "smoke.out.jsonl"
        argv = ["score", str(ROOT / "examples/smoke.jsonl"), "-o", str(out), "--no-progress"]
        assert main([*argv, "--target", srv.target]) == 0
    assert len(out.read_text().splitlines()) == len(rows)
    assert "perplexity" in capsys.readouterr().out


def _k8s(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DOCKER / "k8s" / name).read_text()) if d]


def _containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


def test_k8s_replicas_manifest():
    docs = {d["kind"]: d for d in _k8s("replicas.yaml")}
    service, sts = docs["Service"], docs["StatefulSet"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["metadata"]["name"] == "megascore-headless"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = _containers(sts)
    assert container["command"] == ["torchrun"]
    nproc = next(a for a in container["args"] if a.startswith("--nproc-per-node="))
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert int(nproc.split("=")[1]) == gpus == container["resources"]["requests"]["nvidia.com/gpu"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == 50051
    assert container["readinessProbe"]["grpc"]["service"] == "megascore.v1.Scorer"
    assert sts["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == 10001


def test_k8s_multinode_manifest():
    docs = _k8s("multinode.yaml")
    by_name = {d["metadata"]["name"]: d for d in docs}
    leader, worker = by_name["megascore-mn-leader"], by_name["megascore-mn-worker"]
    env = by_name["megascore-mn-env"]["data"]
    assert env["MASTER_ADDR"].startswith("megascore-mn-leader-0.megascore-mn-leader")
    script = by_name["megascore-mn-launch"]["data"]["rendezvous.sh"]
    assert "--node-rank" in script and "--master-addr" in script and "torchrun" in script
    subprocess.run(["sh", "-n"], input=script, text=True, check=True)  # shell syntax
    (lead,) = _containers(leader)
    (work,) = _containers(worker)
    assert "readinessProbe" in lead and "readinessProbe" not in work
    assert {e["value"] for e in lead["env"] if e["name"] == "ROLE"} == {"leader"}
    assert {e["value"] for e in work["env"] if e["name"] == "ROLE"} == {"worker"}
    client_service = by_name["megascore-mn"]
    assert client_service["spec"]["selector"]["megascore/role"] == "leader"
    nnodes = int(env["NNODES"])
    assert leader["spec"]["replicas"] + worker["spec"]["replicas"] == nnodes
