"""Issue 14: weights pushed from a trainer (``UpdateWeights``) through the real server.

* A ``transformers`` trainer (tiny LlamaForCausalLM / MixtralForCausalLM, fp32)
  takes 3 AdamW steps; after each it pushes its ``state_dict()`` with
  ``ScoringClient.push_weights`` into a ``megascore serve`` that started from the
  trainer's initial save (``hf:DIR``). After every push the server's logprobs equal
  the trainer model's own forward (max |delta| <= 1e-4, float64 comparison) and
  ``weights_version`` advances to the pushed label, at TP=1, TP=2 and PP=2 (llama) and
  EP=2 (mixtral, fused expert tensors as transformers >= 5 names them). The same
  with Megatron names (the state dict of a one-rank local-spec GPTModel loaded here
  from the trainer's save) into the TP=2, EP=2 and PP=2 servers; an async push
  without a version gets a generated one.
* Faults on the TP=2 server, while a thread scores without pause: a wrong name, a
  wrong shape, a push missing tensors (INVALID_ARGUMENT naming the tensors), a
  stream cut off mid-way (cancelled), a second push while one is open (ABORTED) —
  after each the old weights keep serving under their version; then a paused push
  completes and a partial push replaces one tensor. No scoring call fails, and
  each response matches the reference of the version it reports.

Four servers (7 ranks) start at once and are shared by every test here.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest
import torch

from megascore.v1 import scoring_pb2 as pb
from megascore_client import AsyncScoringClient, ScoringClient, ScoringError
from testkit.checkpoints import VOCAB, make_hf_model
from tests.e2e.serve import ServeProcess

pytestmark = pytest.mark.timeout(900)

ATOL = 1e-4
START_TIMEOUT_S = 600.0
SERVERS = {  # name -> (family, extra serve flags)
    "llama-tp1": ("llama", ()),
    "llama-tp2": ("llama", ("--nproc", "2", "--tp", "2")),
    "mixtral-ep2": ("mixtral", ("--nproc", "2", "--ep", "2")),
    "llama-pp2": ("llama", ("--nproc", "2", "--pp", "2")),
}
_RNG = np.random.default_rng(14)
SEQS = [_RNG.integers(0, VOCAB, n).tolist() for n in (5, 17, 32)]


def reference(model, sequences=SEQS) -> list[np.ndarray]:
    """float64 ``[L-1]`` target logprobs of each sequence, from the model itself (eval)."""
    model.eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            lp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)[:-1]
            out.append(lp.gather(-1, ids[0, 1:, None])[:, 0].numpy())
    return out


def max_error(result, refs) -> float:
    pairs = zip(result.logprobs, refs, strict=True)
    return max(float(np.abs(lp[1:].astype(np.float64) - ref).max()) for lp, ref in pairs)


def train_step(model, optimizer, step: int) -> None:
    """One AdamW step on a random batch (next-token cross-entropy)."""
    model.train()
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (4, 24), generator=gen)
    loss = model(ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    model.eval()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """name -> running ServeProcess, all started at once from the families' initial saves."""
    root = tmp_path_factory.mktemp("push")
    for family in {f for f, _ in SERVERS.values()}:
        make_hf_model(family, 0).save_pretrained(root / family)
    procs = {
        name: ServeProcess(
            root / f"{name}.log",
            "--model",
            f"hf:{root / family}",
            "--grace-s",
            "5",
            *flags,
            env={"MASTER_PORT": "0"},
        )
        for name, (family, flags) in SERVERS.items()
    }
    try:
        for proc in procs.values():
            proc.wait_serving(timeout=START_TIMEOUT_S)
        yield procs
        for name, proc in procs.items():
            assert proc.terminate() == 0, f"{name}:\n{proc.output()}"
            assert proc.leftovers() == [], name
    finally:
        for proc in procs.values():
            proc.close()


@pytest.mark.parametrize("name", list(SERVERS))
def test_pushes_after_training_steps_match_the_trainer(servers, name):
    family = SERVERS[name][0]
    trainer = make_hf_model(family, 0)  # what the server started from
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=3e-3)
    with ScoringClient(servers[name].target, timeout=120) as client:
        # the checkpoint it started from, again: the module's other tests push, in any order
        client.load_weights(f"hf:{servers[name].log_path.parent / family}")
        before = client.score(SEQS)
        assert max_error(before, reference(trainer)) <= ATOL
        versions = [before.weights_version]
        for step in range(3):
            old_refs = reference(trainer)
            train_step(trainer, optimizer, step)
            label = f"{name}-step{step}"
            pushed = client.push_weights(trainer.state_dict().items(), weights_version=label)
            assert pushed.weights_version == label
            assert pushed.previous_weights_version == versions[-1]
            assert pushed.num_tensors == len(trainer.state_dict())
            assert pushed.num_bytes == sum(t.numel() * 4 for t in trainer.state_dict().values())
            assert pushed.bytes_per_s > 0
            result = client.score(SEQS)
            assert result.weights_version == label
            assert client.model_info().weights_version == label
            new_refs = reference(trainer)
            assert max_error(result, new_refs) <= ATOL, (step, max_error(result, new_refs))
            assert max_error(result, old_refs) > 100 * ATOL  # the step changed the logprobs
            versions.append(label)


@pytest.fixture(scope="module")
def megatron_state(pgs):
    """megatron_state(hf_dir) -> the Megatron state dict of a one-rank local-spec GPTModel
    built in this process and loaded from ``hf_dir`` (the canonical, unsharded names)."""
    from megascore.checkpoint import resolve_model
    from megascore.config import EngineConfig
    from megascore.model.build import build_model

    def build(hf_dir):
        config, load, _ = resolve_model(f"hf:{hf_dir}")
        model = build_model(config, EngineConfig(device="cpu"), pgs)
        load(model)
        return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}

    return build


@pytest.mark.parametrize("name", ["llama-tp2", "mixtral-ep2", "llama-pp2"])
def test_megatron_names_push(servers, name, megatron_state, tmp_path):
    family = SERVERS[name][0]
    trainer = make_hf_model(family, 5)
    trainer.save_pretrained(tmp_path)
    state = megatron_state(tmp_path)
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in state
    if family == "mixtral":  # every expert by its global index
        assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in state
    with ScoringClient(servers[name].target, timeout=120) as client:
        pushed = client.push_weights(
            state.items(), names="megatron", weights_version=f"{name}-mcore"
        )
        assert pushed.num_tensors == len(state)
        result = client.score(SEQS)
    assert result.weights_version == f"{name}-mcore"
    assert max_error(result, reference(trainer)) <= ATOL


def test_async_push_generates_a_version(servers):
    trainer = make_hf_model("llama", 3)

    async def push():
        async with AsyncScoringClient(servers["llama-tp1"].target) as client:
            pushed = await client.push_weights(
                ((n, t.to(torch.float64)) for n, t in trainer.state_dict().items())
            )
            return pushed, await client.score(SEQS)

    import asyncio

    pushed, result = asyncio.run(push())
    assert pushed.weights_version.startswith("push-") and len(pushed.weights_version) == 17
    assert result.weights_version == pushed.weights_version
    assert max_error(result, reference(trainer)) <= ATOL


# ------------------------------------------------------------------------ faults


class Scorer(threading.Thread):
    """Scores SEQS without pause; checks each answer against its version's reference."""

    def __init__(self, target: str, refs: dict[str, list[np.ndarray]]):
        super().__init__(daemon=True)
        self.client = ScoringClient(target, timeout=120)
        self.refs = refs
        self.stop = threading.Event()
        self.seen: dict[str, int] = {}
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                result = self.client.score(SEQS)
            except ScoringError as exc:
                self.failures.append(f"{exc.code.name}: {exc.details}")
                continue
            version = result.weights_version
            self.seen[version] = self.seen.get(version, 0) + 1
            if version not in self.refs:
                self.failures.append(f"unknown version {version!r}")
            elif (err := max_error(result, self.refs[version])) > ATOL:
                self.failures.append(f"{version}: max error {err}")

    def count(self, version: str) -> int:
        return self.seen.get(version, 0)


def _expect(code, call) -> str:
    with pytest.raises(ScoringError) as info:
        call()
    assert info.value.code is code, info.value
    return info.value.details


def _paused_push(stub, state_dict, version: str, resume: threading.Event, after: int):
    """A raw UpdateWeights call whose request stream stops after ``after`` tensors until
    ``resume`` is set; returns its future."""

    def requests():
        yield pb.UpdateWeightsRequest(begin=pb.UpdateWeightsBegin(names=pb.WEIGHT_NAMES_HF))
        for i, (name, tensor) in enumerate(state_dict.items()):
            if i == after:
                resume.wait(120)
            data = pb.Array(dtype=pb.DTYPE_FLOAT32, data=tensor.numpy().tobytes())
            yield pb.UpdateWeightsRequest(
                chunk=pb.TensorChunk(name=name, shape=tensor.shape, data=data)
            )
        yield pb.UpdateWeightsRequest(commit=pb.UpdateWeightsCommit(weights_version=version))

    return stub.UpdateWeights.future(requests(), timeout=120)


def test_faults_keep_the_old_weights_serving(servers):
    server = servers["llama-tp2"]
    models = {v: make_hf_model("llama", seed) for v, seed in (("A", 10), ("B", 11), ("C", 12))}
    refs = {v: reference(m) for v, m in models.items()}
    state = {v: m.state_dict() for v, m in models.items()}
    with ScoringClient(server.target, timeout=120) as client:
        client.push_weights(state["A"].items(), weights_version="A")
        scorer = Scorer(server.target, refs)
        scorer.start()
        try:

            def still_a(after: str) -> None:
                assert client.model_info().weights_version == "A", after
                result = client.score(SEQS)
                assert result.weights_version == "A", after
                assert max_error(result, refs["A"]) <= ATOL, after

            wrong_name = [*state["B"].items(), ("model.layers.0.mlp.bogus.weight", torch.ones(3))]
            details = _expect(
                grpc.StatusCode.INVALID_ARGUMENT, lambda: client.push_weights(wrong_name)
            )
            assert "model.layers.0.mlp.bogus.weight" in details and "not a tensor" in details
            still_a("wrong name")

            bad = "model.layers.1.self_attn.q_proj.weight"
            wrong_shape = [(n, t[:, :-1] if n == bad else t) for n, t in state["B"].items()]
            details = _expect(
                grpc.StatusCode.INVALID_ARGUMENT, lambda: client.push_weights(wrong_shape)
            )
            assert bad in details and "[64, 63]" in details and "[64, 64]" in details
            still_a("wrong shape")

            missing = [(n, t) for n, t in state["B"].items() if "layers.1." not in n]
            details = _expect(
                grpc.StatusCode.INVALID_ARGUMENT, lambda: client.push_weights(missing)
            )
            assert "not sent" in details and "model.layers.1." in details
            still_a("missing tensors")

            # Cut off: the client cancels the call mid-stream.
            resume = threading.Event()
            future = _paused_push(server.stub(), state["B"], "B", resume, after=5)
            time.sleep(1.0)
            future.cancel()
            resume.set()
            with pytest.raises(grpc.FutureCancelledError):
                future.result()
            time.sleep(0.5)
            still_a("cut off")

            # Concurrent: a second push while one is open mid-stream is ABORTED.
            resume = threading.Event()
            future = _paused_push(server.stub(), state["B"], "B", resume, after=7)
            time.sleep(1.0)
            details = _expect(
                grpc.StatusCode.ABORTED, lambda: client.push_weights(state["C"].items())
            )
            assert "in progress" in details
            scored_while_open = scorer.count("A")
            time.sleep(1.0)
            assert scorer.count("A") > scored_while_open  # scoring goes on meanwhile
            still_a("concurrent push refused")
            resume.set()
            assert future.result().weights_version == "B"
            assert client.score(SEQS).weights_version == "B"

            # Partial: only the final norm of C; the rest stays B.
            partial = models["B"]
            with torch.no_grad():
                partial.model.norm.weight.copy_(models["C"].model.norm.weight)
            refs["B+norm"] = reference(partial)
            norm = [("model.norm.weight", state["C"]["model.norm.weight"])]
            details = _expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: client.push_weights(norm))
            assert "partial" in details
            pushed = client.push_weights(norm, weights_version="B+norm", partial=True)
            assert pushed.previous_weights_version == "B"
            result = client.score(SEQS)
            assert result.weights_version == "B+norm"
            assert max_error(result, refs["B+norm"]) <= ATOL
            time.sleep(0.5)
        finally:
            scorer.stop.set()
            scorer.join(60)
            scorer.client.close()
    assert scorer.failures == []
    assert scorer.count("A") > 0 and scorer.count("B+norm") > 0, scorer.seen
    assert set(scorer.seen) <= {"A", "B", "B+norm"}
