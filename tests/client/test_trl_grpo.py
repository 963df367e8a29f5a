"""``megascore_client.trl_grpo``: TRL's GRPOTrainer without a local reference model.

The trainer built on real TRL holds no reference model (TRL's loader is never called)
and keeps its ``beta``; a reference forward goes to the server with TRL's arguments
(completion width, sampling temperature); ``sync_ref_model`` and multimodal inputs
are refused by name, and so is the LoRA path's ``adapter=`` on a model without peft. The
numbers (reference logprobs and losses equal to TRL's own
over GRPO steps) are checked end to end in ``tests/e2e/test_trl_example.py``.
"""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import tokenizers
import torch
import transformers
import trl
import trl.trainer.grpo_trainer

from megascore_client import ScoringClient
from megascore_client.trl_grpo import MegascoreGRPOTrainer, RemoteReference


class RecordingClient:
    """Stands for a ScoringClient: records ``score_responses`` calls, answers -1.0."""

    def __init__(self):
        self.calls = []

    def score_responses(self, input_ids, attention_mask, responses, **kwargs):
        self.calls.append((input_ids, attention_mask, responses, kwargs))
        return torch.full(responses.shape, -1.0) * attention_mask[:, -responses.shape[1] :]


def _trainer(tmp_path, reference, *, served=None, **config) -> MegascoreGRPOTrainer:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_hidden_layers=1,
            vocab_size=64,
        )
    )
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 64)}}
    core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>"
    )
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        report_to="none",
        use_cpu=True,
        bf16=False,
        **config,
    )
    return MegascoreGRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": ["w2 w3"] * 4}),
        processing_class=tokenizer,
        reference=reference,
        **(served or {}),
    )


@pytest.fixture
def no_local_reference(monkeypatch):
    """TRL's loader of the reference model fails the test if called."""

    def refuse(*args, **kwargs):
        raise AssertionError("GRPOTrainer loaded a local reference model")

    monkeypatch.setattr(trl.trainer.grpo_trainer, "create_model_from_path", refuse)


def test_the_trainer_holds_no_reference_model_and_keeps_its_beta(tmp_path, no_local_reference):
    client = RecordingClient()
    trainer = _trainer(tmp_path, client, beta=0.04, temperature=0.7)
    assert isinstance(trainer, trl.GRPOTrainer)
    assert isinstance(trainer.ref_model, RemoteReference) and trainer.ref_model.client is client
    assert trainer.beta == 0.04 and trainer.args.beta == 0.04

    # a reference forward: the server is asked, with TRL's completion width and temperature
    ids = torch.tensor([[0, 5, 6, 7, 8, 0], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    logps, entropies, aux = trainer._get_per_token_logps_and_entropies(
        trainer.ref_model, ids, mask, 3, batch_size=1, num_images=None
    )
    [(sent_ids, sent_mask, responses, kwargs)] = client.calls
    assert sent_ids is ids and sent_mask is mask and torch.equal(responses, ids[:, -3:])
    assert kwargs == {"temperature": 0.7}
    assert entropies is None and aux is None
    np.testing.assert_array_equal(logps.numpy(), [[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]])

    # the policy's own forward stays TRL's
    own, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, 3)
    assert own.shape == (2, 3) and client.calls == [client.calls[0]]

    with pytest.raises(ValueError, match="pixel_values"):
        trainer._get_per_token_logps_and_entropies(
            trainer.ref_model, ids, mask, 3, pixel_values=torch.zeros(1)
        )


def test_a_target_string_makes_a_client(tmp_path, no_local_reference):
    trainer = _trainer(tmp_path, "127.0.0.1:1", beta=0.1)  # nothing is sent yet
    assert isinstance(trainer.ref_model.client, ScoringClient)
    trainer.ref_model.client.close()


def test_sync_ref_model_is_refused_by_name(tmp_path, no_local_reference):
    with pytest.raises(ValueError, match="sync_ref_model"):
        _trainer(tmp_path, RecordingClient(), beta=0.1, sync_ref_model=True)


def test_without_beta_trl_uses_no_reference_at_all(tmp_path, no_local_reference):
    trainer = _trainer(tmp_path, RecordingClient(), beta=0.0)
    assert trainer.ref_model is None and trainer.beta == 0.0


def test_an_adapter_name_without_a_peft_model_is_refused(tmp_path, no_local_reference):
    with pytest.raises(ValueError, match="'policy-lora': the trainer's model is not a peft"):
        _trainer(tmp_path, RecordingClient(), served={"adapter": "policy-lora"}, beta=0.1)
