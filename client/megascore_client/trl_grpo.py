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

LoRA (TRL's ``peft_config``): the server holds the base only (no reference server: the
reference of a LoRA run is its base) and ``adapter="policy-lora"`` names where the
trainer's adapter is served. Before each generation batch the trainer pushes its
adapter there (``ScoringClient.push_adapter``, the adapter's bytes only); the old
policy's logprobs (``old_per_token_logps``, the importance ratio's denominator) are
then the served adapter's, and the reference's come with them in one call
(``score(model=adapter, reference=base)``).

:class:`MegascoreReference` is the mixin itself, for trainers that already subclass
``GRPOTrainer``: ``class MyTrainer(MegascoreReference, MyGRPOTrainer)``. The ready-made
``MegascoreGRPOTrainer`` is built on first use, so importing this module loads neither
TRL nor torch. Not supported: ``sync_ref_model`` (the server keeps the initial
weights; push new ones with ``client.push_weights`` instead) and multimodal inputs.
"""

from __future__ import annotations

from megascore_client.client import ScoringClient
from megascore_client.trainer_layouts import verl_layout

__all__ = ["MegascoreGRPOTrainer", "MegascoreReference", "RemoteReference"]


class RemoteReference:
    """Where ``GRPOTrainer`` keeps its reference model: the server that serves it.

    Args:
        client: a client of the server serving the reference weights.
    """

    def __init__(self, client: ScoringClient):
        self.client = client
        self.policy: str = ""  # the served adapter the old policy is scored with ("" none)
        self.base: str = ""  # the weight set the reference is scored with ("" the default)
        self.version: str = ""  # the policy adapter's pushed version (a pin)
        self.policy_logprobs = None  # the policy's logprobs of the last call (the adapter path)

    def scored(self, input_ids, attention_mask, logits_to_keep: int, temperature, policy: bool):
        """One call: the completions' logprobs under ``base`` and, with ``policy``, under
        the ``policy`` adapter (``model=policy, reference=base``: the KL's two forwards
        on the server). Returns ``(reference, policy or None)`` in TRL's layout."""
        completions = input_ids[:, -logits_to_keep:]
        layout = verl_layout(input_ids, attention_mask, completions)
        if not layout.sequences:
            empty = layout.logprobs(None)
            return empty, (empty.clone() if policy else None)
        options = {"temperature": temperature}
        if policy:
            options |= {"model": self.policy, "reference": self.base}
            options["weights_version"] = self.version
        else:
            options["model"] = self.base
        result = self.client.score(layout.sequences, **layout.score_arguments(options))
        if not policy:
            return layout.logprobs(result.logprobs), None
        return layout.logprobs(result.reference_logprobs), layout.logprobs(result.logprobs)

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
        if not (self.policy or self.base):  # one set: score_responses, as before
            completions = input_ids[:, -logits_to_keep:]
            return self.client.score_responses(
                input_ids, attention_mask, completions, temperature=temperature
            )
        reference, self.policy_logprobs = self.scored(
            input_ids, attention_mask, logits_to_keep, temperature, bool(self.policy)
        )
        return reference


class MegascoreReference:
    """Mixin for ``GRPOTrainer`` (first in the bases): reference logprobs from a server.

    Args:
        reference: a :class:`ScoringClient` of the server that serves the reference
            (initial) weights, or its target (``"host:port"``). With a peft model (TRL's
            ``peft_config``) the server holds the base the adapter trains over.
        adapter: the LoRA path (a peft model only): the name the trainer's adapter is
            served under. Before each generation batch the trainer pushes its adapter
            there (``push_adapter``: ``get_peft_model_state_dict`` and its ``LoraConfig``,
            version ``f"{adapter}-{n}"``); the old policy's logprobs
            (``old_per_token_logps``) are that adapter's on the server, and with
            ``beta > 0`` the reference's come in the same call (``model=adapter,
            reference=`` the adapter's base set). None: no push; the reference (base)
            alone comes from the server, the old policy stays TRL's.
        *args, **kwargs: those of ``GRPOTrainer``.

    Raises:
        ValueError: ``sync_ref_model`` is set (it would mix the policy into a reference
            the trainer does not hold), or ``adapter`` without a peft model.
    """

    def __init__(self, *args, reference: ScoringClient | str, adapter: str | None = None, **kwargs):
        config = kwargs["args"] if "args" in kwargs else (args[2] if len(args) > 2 else None)
        beta = getattr(config, "beta", 0.0)
        if getattr(config, "sync_ref_model", False) and beta != 0.0:
            raise ValueError(
                "sync_ref_model: not supported with a megascore reference (the trainer holds "
                "no reference model to mix); push the weights the reference should have to "
                "its server with ScoringClient.push_weights"
            )
        if config is not None:
            config.beta = 0.0  # GRPOTrainer then builds no reference model
        try:
            super().__init__(*args, **kwargs)
        finally:
            if config is not None:
                config.beta = beta
        if config is not None:
            self.beta = beta
        client = ScoringClient(reference) if isinstance(reference, str) else reference
        self._served = RemoteReference(client)
        self._pushes = 0
        if adapter is not None:
            from accelerate.utils import is_peft_model

            if not is_peft_model(self.accelerator.unwrap_model(self.model)):
                raise ValueError(
                    f"adapter={adapter!r}: the trainer's model is not a peft model (give "
                    "GRPOTrainer a peft_config, or a PeftModel)"
                )
            self._served.policy = adapter
        if self.beta != 0.0:
            self.ref_model = self._served

    def _push_policy(self) -> None:
        """Pushes the trainer's adapter (the weights about to generate: the old policy)
        to its served name; every process waits for the main one's push."""
        from peft import get_peft_model_state_dict

        served = self._served
        model = self.accelerator.unwrap_model(self.model)
        version = f"{served.policy}-{self._pushes}"
        self._pushes += 1
        if self.accelerator.is_main_process:
            name = model.active_adapter
            state = get_peft_model_state_dict(model, adapter_name=name)
            served.client.push_adapter(
                served.policy,
                {k: v.detach().cpu() for k, v in state.items()},
                model.peft_config[name],
                weights_version=version,
            )
        self.accelerator.wait_for_everyone()
        if not served.base:  # the reference: the set the adapter is served over
            models = {m.name: m for m in served.client.model_info().models}
            served.base = models[served.policy].base
        served.version = version

    def _generate_and_score_completions(self, inputs):
        served = self._served
        if not served.policy:
            return super()._generate_and_score_completions(inputs)
        self._push_policy()
        served.policy_logprobs = None
        output = super()._generate_and_score_completions(inputs)
        if served.policy_logprobs is None:  # beta = 0: no reference call, the policy alone
            ids = torch_cat(output["prompt_ids"], output["completion_ids"])
            mask = torch_cat(output["prompt_mask"], output["completion_mask"])
            width = output["completion_ids"].shape[1]
            _, served.policy_logprobs = served.scored(ids, mask, width, self.temperature, True)
        output["old_per_token_logps"] = served.policy_logprobs
        served.policy_logprobs = None
        return output

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


def torch_cat(left, right):
    """``torch.cat([left, right], dim=1)`` (torch imported here: the trainer loaded it)."""
    import torch

    return torch.cat([left, right], dim=1)


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
