"""Issue 25: weights across two ``megascore serve --model tiny`` replicas (CPU).

* Version pins: one replica reloads seed 7 (``builtin:tiny@7``); through the SDK's
  round robin over both, a request pinned to either version is always answered by
  the replica serving it (the other refuses it and the SDK re-sends it), with that
  replica's own numbers; a pin no replica serves fails with FAILED_PRECONDITION
  naming both versions, and both replicas keep serving.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from megascore_client import ScoringClient, ScoringError
from tests.e2e.serve import ServeProcess

pytestmark = pytest.mark.timeout(900)

SEQS = [[1, 5, 9, 200, 31], [7, 7, 300, 2]]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("replicas")
    servers = [ServeProcess(log_dir / f"r{i}.log", "--model", "tiny") for i in range(2)]
    try:
        for server in servers:
            server.wait_serving()
        yield servers
    finally:
        for server in servers:
            server.close()


def round_robin(servers) -> ScoringClient:
    target = "ipv4:" + ",".join(s.target for s in servers)
    return ScoringClient(target, load_balancing="round_robin", timeout=60)


def test_pinned_requests_are_answered_by_the_replica_serving_their_version(replicas):
    first, second = replicas
    with ScoringClient(second.target, timeout=120) as direct:
        seeded = direct.load_weights("builtin:tiny@7").weights_version
        want_new = direct.score(SEQS, losses=())
    with ScoringClient(first.target, timeout=60) as direct:
        want_old = direct.score(SEQS, losses=())
    old = want_old.weights_version
    assert (old, seeded) == ("builtin:tiny@1234", "builtin:tiny@7")
    with round_robin(replicas) as client:
        for _ in range(4):
            for version, want in ((old, want_old), (seeded, want_new)):
                got = client.score(SEQS, losses=(), weights_version=version)
                assert got.weights_version == version
                for a, b in zip(got.logprobs, want.logprobs, strict=True):
                    np.testing.assert_array_equal(a, b)
        with pytest.raises(ScoringError) as info:
            client.score(SEQS, weights_version="builtin:tiny@99")
        assert info.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert "'builtin:tiny@99'" in info.value.details
        assert {client.score(SEQS).weights_version for _ in range(4)} == {old, seeded}
    with ScoringClient(second.target, timeout=120) as direct:
        assert direct.load_weights("builtin:tiny@1234").weights_version == old
