"""A LoRA adapter's push (``push_adapter``): a peft model's adapter state dict and config
as the keywords of ``push_weights`` (docs/client.md "LoRA adapters"). Torch-free: the
tensors go as they come (torch tensors are encoded by ``push.requests``)."""

from __future__ import annotations

import json

from megascore_client.errors import InvalidInputError

__all__ = ["adapter_push"]


def _config_json(config) -> str:
    """``adapter_config.json`` text of a peft ``LoraConfig`` (``to_dict()``), a dict, a JSON
    string or None ("": the server keeps the adapter's config)."""
    if config is None:
        return ""
    if isinstance(config, str):
        return config
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return json.dumps(
        data, default=lambda value: sorted(value) if isinstance(value, set) else str(value)
    )


def adapter_push(name: str, state_dict, config=None) -> dict:
    """The ``push_weights`` keywords that push adapter ``name`` whole.

    Args:
        name: the adapter's served name.
        state_dict: ``{peft tensor name: tensor}``, as ``peft.get_peft_model_state_dict``
            gives it (full tensors, numpy or torch).
        config: the adapter's ``LoraConfig`` (or its dict / JSON); None: the adapter's
            config on the server (an adapter it holds already).

    Raises:
        InvalidInputError: no name, or no tensor.
    """
    if not name:
        raise InvalidInputError("push_adapter: the adapter's name is required")
    tensors = list(state_dict.items())
    if not tensors:
        raise InvalidInputError(f"push_adapter {name!r}: the state dict holds no tensor")
    return dict(
        named_tensors=tensors, names="peft", adapter=name, adapter_config=_config_json(config)
    )
