"""Prometheus endpoint on its own port: counters, gauges and histograms of real traffic."""

from __future__ import annotations

import re
import urllib.error
import urllib.request

import grpc
import pytest

from megascore_server.ports import pick_port
from tests.service.fake_engine import FakeEngine
from tests.service.harness import Req, ServerThread, check_response


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def value(text: str, series: str) -> float:
    match = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
    assert match, f"{series} not in metrics"
    return float(match.group(1))


def test_metrics_endpoint_serves_counters():
    srv = ServerThread(
        FakeEngine(), metrics_port=pick_port(), max_tokens_per_batch=64, pad_multiple=4
    )
    port = srv.handles.metrics_port
    try:
        stub = srv.stub()
        reqs = [
            Req([[1, 2, 3], [4, 5, 6, 7, 8]], request_id="m1"),
            Req([[9] * 30], request_id="m2"),
        ]
        for req in reqs:
            check_response(stub.Score(req.proto(), timeout=5), req)
        list(stub.ScoreStream(iter([reqs[0].proto()]), timeout=5))
        with pytest.raises(grpc.RpcError):
            stub.Score(Req([[1, 2]], top_k=-1).proto(), timeout=5)
        text = scrape(port)
        assert value(text, 'megascore_requests_total{code="OK",front="grpc",rpc="Score"}') == 2
        assert (
            value(text, 'megascore_requests_total{code="OK",front="grpc",rpc="ScoreStream"}') == 1
        )
        assert (
            value(
                text, 'megascore_requests_total{code="INVALID_ARGUMENT",front="grpc",rpc="Score"}'
            )
            == 1
        )
        assert value(text, "megascore_tokens_scored_total") == 8 + 30 + 8
        assert value(text, "megascore_queue_depth") == 0
        steps = value(text, "megascore_steps_total")
        assert steps >= 2
        assert value(text, "megascore_step_latency_seconds_count") == steps
        assert value(text, "megascore_batch_fill_ratio_count") == steps
        # lengths 3, 5, 30 padded to 4, 8, 32: overhead is observed and positive.
        assert value(text, "megascore_padding_overhead_sum") > 0
        assert value(text, 'megascore_request_latency_seconds_count{front="grpc",rpc="Score"}') == 3
        layout = 'cp="1",ep="1",model="fake",pp="1",tp="1",world_size="1"'
        assert value(text, f"megascore_model_info{{{layout}}}") == 1
    finally:
        srv.stop()
    with pytest.raises(urllib.error.URLError):
        scrape(port)
