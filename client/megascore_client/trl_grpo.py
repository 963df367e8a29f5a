"""TRL's ``GRPOTrainer`` with its reference logprobs from a megascore server.

``GRPOTrainer`` (TRL, the ``trl`` extra) keeps a full copy of the initial model to
compute the reference logprobs of the KL term. :class:`MegascoreGRPOTrainer` is the
same trainer without that copy: the reference logprobs of every generation batch
come from a megascore server that serves the initial weights (``megascore serve
--model hf:DIR``, DIR being what the policy was loaded from). Three lines change::

    from megascore_client.trl_grpo import MegascoreGRPOTrainer
    trainer = MegascoreGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(beta=0.04),
                                   train_dataset=..., reference="127.0.0.1:50051")

How: ``GRPOTrainer.__init__`` builds the reference model only when ``args.beta`` is not
0, so the trainer is built with ``beta = 0`` and gets its ``beta`` back afterwards;
then :class:`RemoteReference` stands where the reference model would, and the one
method TRL computes the reference logprobs with, ``_get_per_token_logps_and_entropies``
(called with ``self.ref_model``), asks the server for that model: the verl layout of
:meth:`ScoringClient.score_responses` is TRL's (left-padded prompts, right-padded
completions, the logprob of completion token j in column j, 0.0 on padding), at the
trainer's sampling ``temperature``. The loss is TRL's, unchanged.

:class:`MegascoreReference` is the mixin itself, for trainers that already subclass
``GRPOTrainer``: ``class MyTrainer(MegascoreReference, MyGRPOTrainer)``. The ready-made
``MegascoreGRPOTrainer`` is built on first use, so importing this module loads neither
TRL nor torch. Not supported: ``sync_ref_model`` (the server keeps the initial
weights; push new ones with ``client.push_weights`` instead) and multimodal inputs.
"""

from __future__ import annotations

from megascore_client.client import ScoringClient

__all__ = ["MegascoreGRPOTrainer", "MegascoreReference", "RemoteReference"]


class RemoteReference:
    """Where ``GRPOTrainer`` keeps its reference model: the server that serves it.

    Args:
        client: a client of the server serving the reference weights.
    """

    def __init__(self, client: ScoringClient):
        self.client = client

    def completion_logprobs(self, input_ids, attention_mask, logits_to_keep: int, temperature):
        """Reference logprobs of the completions, in TRL's layout.

        Args:
            input_ids: int ``[B, P + C]``: left-padded prompts then right-padded
                completions (TRL's ``prompt_completion_ids``).
            attention_mask: 0/1 ``[B, P + C]``, 1 on real tokens.
            logits_to_keep: ``C``, the completion width.
            temperature: the trainer's sampling temperature (logits are divided by it).

        Returns:
            float32 ``[B, C]`` on the device of ``input_ids``: the logprob of completion
            token j given the real tokens before it, 0.0 on padding.
        """
        completions = input_ids[:, -logits_to_keep:]
        return self.client.score_responses(
            input_ids, attention_mask, completions, temperature=temperature
        )


class MegascoreReference:
    """Mixin for ``GRPOTrainer`` (first in the bases): reference logprobs from a server.

    Args:
        reference: a :class:`ScoringClient` of the server that serves the reference
            (initial) weights, or its target (``"host:port"``).
        *args, **kwargs: those of ``GRPOTrainer``.

    Raises:
        ValueError: ``sync_ref_model`` is set (it would mix the policy into a reference
            the trainer does not hold).
    """

    def __init__(self, *args, reference: ScoringClient | str, **kwargs):
        config = kwargs["args"] if "args" in kwargs else (args[2] if len(args) > 2 else None)
        beta = getattr(config, "beta", 0.0)
        if beta == 0.0:  # no KL term: TRL uses no reference model at all
            super().__init__(*args, **kwargs)
            return
        if getattr(config, "sync_ref_model", False):
            raise ValueError(
                "sync_ref_model: not supported with a megascore reference (the trainer holds "
                "no reference model to mix); push the weights the reference should have to "
                "its server with ScoringClient.push_weights"
            )
        config.beta = 0.0  # GRPOTrainer then builds no reference model
        try:
            super().__init__(*args, **kwargs)
        finally:
            config.beta = beta
        self.beta = beta
        client = ScoringClient(reference) if isinstance(reference, str) else reference
        self.ref_model = RemoteReference(client)

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
    ):
        if not isinstance(model, RemoteReference):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
            )
        unused = ("batch_size",)  # the client splits a batch under the server's limits
        extra = sorted(
            k for k, v in kwargs.items() if v is not None and v is not False and k not in unused
        )
        if args or extra:
            raise ValueError(
                f"a megascore reference scores token ids only; got {extra or 'more arguments'}"
            )
        logps = model.completion_logprobs(
            input_ids, attention_mask, logits_to_keep, self.temperature
        )
        return logps, None, None


def _grpo_trainer_class():
    from trl import GRPOTrainer

    return type(
        "MegascoreGRPOTrainer",
        (MegascoreReference, GRPOTrainer),
        {"__module__": __name__, "__doc__": "``trl.GRPOTrainer`` + :class:`MegascoreReference`."},
    )


# Built on first use by the module's __getattr__ (PEP 562): importing this module loads
# neither TRL nor torch. (Annotated, not assigned: the name stays out of globals() until then.)
MegascoreGRPOTrainer: type


def __getattr__(name: str):
    if name == "MegascoreGRPOTrainer":
        globals()[name] = built = _grpo_trainer_class()
        return built
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
