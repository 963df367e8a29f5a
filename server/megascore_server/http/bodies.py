"""An HTTP body -> the route's pydantic model, large ones in a process of their own.

Both fronts share rank 0's event loop, so a body parsed on it holds every other client
for as long as the parse takes, and so does one parsed in a thread: the parse is a few
long calls into pydantic's Rust that keep the GIL (~0.25 s for 4 MiB of ids). Here a
body is parsed and validated by the model in one pass of pydantic's JSON parser
(FastAPI's stdlib ``json`` + validation took 4-8x as long); a body of
:data:`INLINE_BYTES` or more is parsed in a worker process, one at a time (the others
wait for their turn, their bytes already read), which sends token-id prompts back as
arrays (:class:`IdArrays`: unpickling two million Python ints would hold the loop
0.2 s again). The worker trims its memory after each body, this process once large
requests stop coming (:class:`~megascore_server.memory_trim.MemoryTrim`), and the
worker ends when large bodies stop coming. Errors are FastAPI's
:class:`~fastapi.exceptions.RequestValidationError`, so the app's handler answers them
as it answers FastAPI's own (``body: not valid JSON``, ``prompt[0][1]: ...``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import json
import multiprocessing

import numpy as np
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from megascore_server.memory_trim import LARGE_BYTES, MemoryTrim, trim

INLINE_BYTES = LARGE_BYTES
"""Bodies below this size are parsed on the event loop (a few ms at most)."""
WORKER_IDLE_S = 5.0
"""The worker process ends this long after the last large body (its pipes and memory
are not held by a server that gets none)."""


@dataclasses.dataclass(frozen=True)
class IdArrays:
    """Token-id prompts of a large body, as the worker process sends them back."""

    flat: np.ndarray
    """int64 ``[T]``: every prompt's ids, one after the other."""
    lengths: np.ndarray
    """int64 ``[n]``: each prompt's length."""
    batched: bool
    """The body sent a list of prompts (not one prompt)."""

    def prompts(self) -> list[np.ndarray]:
        """Each prompt's ids (views of :attr:`flat`)."""
        return np.split(self.flat, np.cumsum(self.lengths)[:-1])


def _as_arrays(value) -> IdArrays | None:
    """Validated token-id prompts (one list of ints, or a list of them) as arrays; None
    for text, no prompt, or ids beyond int64 (refused later, naming the field)."""
    if not isinstance(value, list) or not value or isinstance(value[0], str):
        return None
    prompts, batched = (value, True) if isinstance(value[0], list) else ([value], False)
    lengths = np.fromiter(map(len, prompts), np.int64, len(prompts))
    try:
        flat = np.fromiter(itertools.chain.from_iterable(prompts), np.int64, int(lengths.sum()))
    except OverflowError:
        return None
    return IdArrays(flat, lengths, batched)


def _invalid(exc: ValidationError) -> RequestValidationError:
    """pydantic's errors as FastAPI's: locations start with ``body``."""
    errors = exc.errors(include_url=False, include_input=False)
    return RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in errors])


def decode(model: type[BaseModel], raw: bytes) -> BaseModel:
    """``raw`` as ``model``, on the calling thread: pydantic's own JSON parser, or the
    stdlib's for the JSON it refuses (lone surrogates: the answers scrub them).

    Raises:
        RequestValidationError: not JSON, or not what ``model`` takes.
    """
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        if exc.errors()[0]["type"] != "json_invalid":
            raise _invalid(exc) from None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested too deep
        error = {"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error"}
        raise RequestValidationError([{**error, "ctx": {"error": str(exc)}}]) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _decode_large(model: type[BaseModel], ids_field: str | None, raw: bytes) -> BaseModel:
    """:func:`decode` in the worker process; the ``ids_field`` prompts as :class:`IdArrays`."""
    try:
        decoded = decode(model, raw)
        arrays = None if ids_field is None else _as_arrays(getattr(decoded, ids_field))
        if arrays is not None:  # the lists go with the first copy, before the trim
            decoded = decoded.model_copy(update={ids_field: arrays})
        return decoded
    finally:
        trim()


class BodyParser:
    """Parses the bodies of one app's routes. Its worker process starts with a large
    body and ends :data:`WORKER_IDLE_S` after the last one (or with :meth:`close`).

    Args:
        memory: told of each large body (the server's :class:`MemoryTrim`).
    """

    def __init__(self, memory: MemoryTrim):
        self._memory = memory
        self._large = asyncio.Semaphore(1)
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._idle: asyncio.TimerHandle | None = None

    async def parse(
        self, model: type[BaseModel], request: Request, ids_field: str | None = None
    ) -> BaseModel:
        """The request's body as ``model``; a large one parsed by the worker process, whose
        ``ids_field`` (token-id prompts) then holds :class:`IdArrays`."""
        raw = await request.body()
        if len(raw) < INLINE_BYTES:
            return decode(model, raw)
        loop = asyncio.get_running_loop()
        async with self._large:
            if self._idle is not None:
                self._idle.cancel()
            if self._pool is None:
                spawn = multiprocessing.get_context("spawn")  # no copy of the server's threads
                self._pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn)
            try:
                return await loop.run_in_executor(self._pool, _decode_large, model, ids_field, raw)
            finally:
                self._idle = loop.call_later(WORKER_IDLE_S, self.close)
                self._memory.saw(len(raw))

    def close(self) -> None:
        """Stops the worker process (a later large body starts another)."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
