"""Token strings of the HTTP answers, and the tokenizer routes (vLLM's shapes).

With a tokenizer, a token's string is what its id decodes to on its own (as vLLM's
``tokens`` / ``top_logprobs`` keys); without one, ``"token_id:N"`` (vLLM's
``return_tokens_as_token_ids``), so every answer can be built either way.
"""

from __future__ import annotations

from megascore_server.tokenizer import ServerTokenizer


class TokenStrings:
    """Strings of token ids, from the tokenizer or as ``token_id:N``.

    Args:
        tokenizer: the server's tokenizer, or None.
        as_ids: ``token_id:N`` even with a tokenizer.
    """

    def __init__(self, tokenizer: ServerTokenizer | None, as_ids: bool = False):
        self._tokenizer = None if as_ids else tokenizer

    def __call__(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.token_string(token_id)

    def text(self, ids) -> str | None:
        """The decoded text of ``ids`` (None without a tokenizer)."""
        return None if self._tokenizer is None else self._tokenizer.decode(ids)

    @property
    def decodes(self) -> bool:
        return self._tokenizer is not None
