"""Text in, text out with the server's tokenizer: ``tokenize``, ``detokenize`` and
``score_text`` of both clients (``Scorer.Tokenize`` / ``Scorer.Detokenize``).

The server tokenizes with its own tokenizer (``megascore serve --tokenizer DIR``, or
the ``hf:DIR`` checkpoint's); one without answers FAILED_PRECONDITION
(``ModelInfo.has_tokenizer`` says which). The codec functions here build the requests
and read the answers; :class:`TextMethods` / :class:`AsyncTextMethods` are the
methods the clients inherit (the same three, sync and awaitable).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megascore.api.wire import decode_array, encode_array
from megascore.v1 import scoring_pb2 as pb
from megascore_client.errors import InvalidInputError, malformed_response
from megascore_client.inputs import as_numpy
from megascore_client.results import ScoreResult

__all__ = [
    "AsyncTextMethods",
    "Detokenized",
    "TextMethods",
    "TextScoreResult",
    "detokenize_request",
    "read_detokenized",
    "read_token_ids",
    "tokenize_request",
]

_INTS = (pb.DTYPE_INT32, pb.DTYPE_INT64)


@dataclasses.dataclass(frozen=True)
class Detokenized:
    """What ``detokenize`` returns.

    Attributes:
        texts: one decoded text per sequence.
        tokens: per sequence, one string per id: what that id decodes to on its own.
    """

    texts: list[str]
    tokens: list[list[str]]


@dataclasses.dataclass
class TextScoreResult:
    """What ``score_text`` returns: the :class:`ScoreResult` of the tokenized texts and
    the tokens it scored. Every ``ScoreResult`` field reads through (``r.logprobs``,
    ``r.loss["nll"]``, ...).

    Attributes:
        result: the scores; ``result.logprobs[i][t]`` is token ``t`` of text ``i``.
        token_ids: per text, int64 ``[L_i]``: the ids the server's tokenizer gave.
        tokens: per text, the string of each id (``return_tokens=True``; else None).
    """

    result: ScoreResult
    token_ids: list[np.ndarray]
    tokens: list[list[str]] | None = None

    def __getattr__(self, name: str):
        if name == "result":  # not set yet (copy / unpickling)
            raise AttributeError(name)
        return getattr(self.result, name)


def _texts(texts) -> list[str]:
    if isinstance(texts, str | bytes):
        raise InvalidInputError("texts must be a list of strings; wrap a single text in a list")
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InvalidInputError(f"texts[{i}] is {type(text).__name__}, not a string")
    return texts


def tokenize_request(texts, add_special_tokens: bool) -> pb.TokenizeRequest:
    """The ``Tokenize`` request of ``texts`` (a list of strings)."""
    return pb.TokenizeRequest(texts=_texts(texts), add_special_tokens=add_special_tokens)


def read_token_ids(response: pb.TokenizeResponse, count: int) -> list[np.ndarray]:
    """The int64 ids of each of ``count`` texts from a ``Tokenize`` answer."""
    ids = decode_array(response.token_ids, "token_ids", _INTS).astype(np.int64)
    lengths = decode_array(response.lengths, "lengths", _INTS).astype(np.int64)
    if lengths.shape[0] != count or int(lengths.sum()) != ids.shape[0] or (lengths < 0).any():
        raise malformed_response(
            f"Tokenize answered {lengths.shape[0]} lengths summing to {int(lengths.sum())} "
            f"for {count} texts and {ids.shape[0]} ids"
        )
    return np.split(ids, np.cumsum(lengths)[:-1]) if count else []


def detokenize_request(ids, skip_special_tokens: bool) -> tuple[pb.DetokenizeRequest, list[int]]:
    """The ``Detokenize`` request of ``ids`` (a list of id sequences: lists, numpy
    arrays, torch tensors) and the length of each sequence."""
    if isinstance(ids, str | bytes) or not hasattr(ids, "__len__"):
        raise InvalidInputError("ids must be a list of token id sequences")
    rows = []
    for i, row in enumerate(ids):
        values = np.asarray(as_numpy(row))
        if values.ndim != 1 or (values.size and values.dtype.kind not in "iu"):
            raise InvalidInputError(f"ids[{i}] must be a 1-D sequence of integer token ids")
        if values.size and values.min() < 0:
            raise InvalidInputError(f"ids[{i}] holds a negative token id")
        rows.append(values.astype(np.int64))
    lengths = [int(r.shape[0]) for r in rows]
    flat = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    request = pb.DetokenizeRequest(
        token_ids=encode_array(flat),
        lengths=encode_array(np.asarray(lengths, dtype=np.int64)),
        skip_special_tokens=skip_special_tokens,
    )
    return request, lengths


def read_detokenized(response: pb.DetokenizeResponse, lengths: list[int]) -> Detokenized:
    """A ``Detokenize`` answer, its token strings cut per sequence."""
    tokens = list(response.tokens)
    if len(response.texts) != len(lengths) or len(tokens) != sum(lengths):
        raise malformed_response(
            f"Detokenize answered {len(response.texts)} texts and {len(tokens)} tokens for "
            f"{len(lengths)} sequences of {sum(lengths)} ids"
        )
    cuts = np.cumsum([0, *lengths]).tolist()
    return Detokenized(
        list(response.texts), [tokens[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    )


class TextMethods:
    """``tokenize`` / ``detokenize`` / ``score_text`` of :class:`ScoringClient`."""

    def tokenize(
        self, texts, *, add_special_tokens: bool = True, timeout: float | None = None
    ) -> list[np.ndarray]:
        """Token ids of ``texts`` by the server's tokenizer.

        Args:
            texts: a list of strings, each tokenized on its own.
            add_special_tokens: add the tokenizer's special tokens (e.g. BOS).
            timeout: deadline in seconds (default: the client's).

        Returns:
            Per text, int64 ``[L_i]`` (``L_i`` may be 0).

        Raises:
            ScoringError: FAILED_PRECONDITION when the server has no tokenizer.
        """
        request = tokenize_request(texts, add_special_tokens)
        stub, deadline = self.transport.stub, self._deadline(timeout)
        response = self._unary(stub.Tokenize, request, deadline, wait=True)
        return read_token_ids(response, len(request.texts))

    def detokenize(
        self, ids, *, skip_special_tokens: bool = False, timeout: float | None = None
    ) -> Detokenized:
        """Texts of id sequences, and each id's token string, by the server's tokenizer.

        Args:
            ids: a list of token id sequences (lists, numpy arrays, torch tensors).
            skip_special_tokens: leave special tokens out of the texts.
            timeout: deadline in seconds (default: the client's).

        Returns:
            :class:`Detokenized` (``texts``, and ``tokens``: one string per id).
        """
        request, lengths = detokenize_request(ids, skip_special_tokens)
        stub, deadline = self.transport.stub, self._deadline(timeout)
        response = self._unary(stub.Detokenize, request, deadline, wait=True)
        return read_detokenized(response, lengths)

    def score_text(
        self,
        texts,
        *,
        add_special_tokens: bool = True,
        return_tokens: bool = False,
        timeout: float | None = None,
        **options,
    ) -> TextScoreResult:
        """Scores texts: tokenized by the server's tokenizer, then :meth:`score`.

        Args:
            texts: a list of strings (each must give at least one token).
            add_special_tokens: as for :meth:`tokenize`.
            return_tokens: also return each token's string (one ``Detokenize`` call).
            timeout: deadline of each call (default: the client's).
            **options: as for :meth:`score` (``top_k``, ``losses``, ...).

        Returns:
            :class:`TextScoreResult`: the scores, the ids and (optionally) the tokens.
        """
        ids = self.tokenize(texts, add_special_tokens=add_special_tokens, timeout=timeout)
        _check_tokens(ids)
        result = self.score(ids, timeout=timeout, **options)
        tokens = self.detokenize(ids, timeout=timeout).tokens if return_tokens else None
        return TextScoreResult(result, ids, tokens)


class AsyncTextMethods:
    """The same methods, awaitable, of ``AsyncScoringClient``."""

    async def tokenize(
        self, texts, *, add_special_tokens: bool = True, timeout: float | None = None
    ) -> list[np.ndarray]:
        """As :meth:`TextMethods.tokenize`."""
        request = tokenize_request(texts, add_special_tokens)
        stub, deadline = self.transport.stub, self._deadline(timeout)
        response = await self._unary(stub.Tokenize, request, deadline, wait=True)
        return read_token_ids(response, len(request.texts))

    async def detokenize(
        self, ids, *, skip_special_tokens: bool = False, timeout: float | None = None
    ) -> Detokenized:
        """As :meth:`TextMethods.detokenize`."""
        request, lengths = detokenize_request(ids, skip_special_tokens)
        stub, deadline = self.transport.stub, self._deadline(timeout)
        response = await self._unary(stub.Detokenize, request, deadline, wait=True)
        return read_detokenized(response, lengths)

    async def score_text(
        self,
        texts,
        *,
        add_special_tokens: bool = True,
        return_tokens: bool = False,
        timeout: float | None = None,
        **options,
    ) -> TextScoreResult:
        """As :meth:`TextMethods.score_text`."""
        ids = await self.tokenize(texts, add_special_tokens=add_special_tokens, timeout=timeout)
        _check_tokens(ids)
        result = await self.score(ids, timeout=timeout, **options)
        tokens = (await self.detokenize(ids, timeout=timeout)).tokens if return_tokens else None
        return TextScoreResult(result, ids, tokens)


def _check_tokens(ids: list[np.ndarray]) -> None:
    for i, row in enumerate(ids):
        if row.shape[0] == 0:
            raise InvalidInputError(f"texts[{i}] gives no token: nothing to score")
