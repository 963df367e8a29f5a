"""The rank-0 -> workers broadcast protocol.

Every engine step starts with rank 0 broadcasting a fixed-size int64 header to
the model-parallel group; the header says what follows. Nothing is pickled:
every payload is a flat buffer of a known dtype whose size the header gives.

Header (``HEADER_SLOTS`` int64, unused slots 0):

====  ================  =====================================================
slot  name              meaning
====  ================  =====================================================
0     command           :class:`Command`
1     version           ``PROTOCOL_VERSION`` (a mismatch is a ``ProtocolError``)
2     step              caller's step id (echoed to workers, for logs)
3     num_tokens        FORWARD: ``T``
4     num_sequences     FORWARD: ``B``
5     (forward slot)    FORWARD: see below (``top_k``)
6     flags             FORWARD: bitmask of the boolean options and the inputs sent
7     losses            FORWARD: bit ``i`` = ``sorted(loss_names)[i]``
8     path_bytes        RELOAD: UTF-8 length of the checkpoint path;
                        FORWARD: see below (``logprob_positions``)
9     version_bytes     RELOAD, WEIGHTS_COMMIT: UTF-8 length of the weights version;
                        FORWARD: see below (routing layers ``L``)
10    name_bytes        WEIGHTS_TENSOR: UTF-8 length of the tensor name;
                        FORWARD: see below (routing top-k ``k``)
11    dtype             WEIGHTS_TENSOR: index in ``WEIGHT_DTYPES``;
                        FORWARD: see below (target ids ``K``)
12    ndim              WEIGHTS_TENSOR: number of dimensions
13    data_bytes        WEIGHTS_TENSOR: byte size of the whole tensor
14    names / layout    WEIGHTS_BEGIN: name format; WEIGHTS_TENSOR: layout code;
                        WEIGHTS_COMMIT: bitmask of ``WEIGHTS_FLAG_*``
15    weight_set        every command: index of the weight set a FORWARD runs on, a
                        RELOAD or WEIGHTS_BEGIN changes (``engine.weights.sets``; 0 else)
====  ================  =====================================================

A FORWARD header is laid out from :mod:`megascore.api.schema`: the boolean options
(``Option.flag``) are flag bits ``0, 1, ...`` in table order, each input sent sets
flag bit ``INPUT_FLAG_BASE + i`` (``i`` its index in ``INPUTS``); the integer options,
then the trailing dimensions of every input (``Input.ndim`` each), take the slots of
``FORWARD_SLOTS`` in table order (today: ``top_k`` in slot 5, ``logprob_positions`` in
slot 8, the routing's ``L`` and ``k`` in slots 9 and 10, the target ids' ``K`` in 11).

Payloads, in order, after the header:

* FORWARD: int64 ``[T + B]`` (token ids, then lengths); then every input the flags
  announce, in ``INPUTS`` order: ``[T, *dims]`` or ``[B]`` values of its dtype, flat
  (today: uint8 loss mask, float32 temperatures, int32 routing to replay); then, with
  flag ``CACHE_FLAG``, the prefix-cache plan (:mod:`megascore.engine.ranks.forward_payloads`).
* RELOAD: uint8 ``[path_bytes + version_bytes]``, the two UTF-8 strings (or nothing).
* ADAPTER: the same, the path's place holding a LoRA adapter's load, push or removal as
  JSON (``megascore.engine.weights.adapters``; a push's tensors follow it).
* SHUTDOWN, WEIGHTS_BEGIN, WEIGHTS_ABORT: nothing.
* WEIGHTS_TENSOR: int64 ``[ndim]`` shape (when ndim > 0); uint8 ``[name_bytes]``
  name. The tensor's bytes are not broadcast: rank 0 then sends each rank only the
  parts of it that rank reads (``megascore.engine.weights.push.transfer``, point to point;
  which parts, ``megascore.engine.weights.push.apply``).
* WEIGHTS_COMMIT: uint8 ``[version_bytes]`` (nothing when empty).

The WEIGHTS_* messages are one weight push (``megascore.engine.weights.push.apply``):
BEGIN, any number of TENSOR, then COMMIT or ABORT; forward steps may come in between.

Rank 0 checks the batch (:meth:`~megascore.api.types.ScoreBatch.check`) before its first
broadcast, so a bad batch raises there and the workers never see a partial message. The
loss registry (``loss_names``) must be identical on every rank; the worker's batch lists
its losses in the registry's sorted order.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from megascore.api import schema
from megascore.api.types import ScoreBatch
from megascore.engine.ranks import forward_payloads

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 4
"""3: slot 15 names the weight set (WEIGHTS_COMMIT's flags moved to slot 14)."""
HEADER_SLOTS = 16
MAX_LOSSES = 63

_H_COMMAND = 0
_H_VERSION = 1
_H_STEP = 2
_H_NUM_TOKENS = 3
_H_NUM_SEQUENCES = 4
_H_TOP_K = 5
_H_FLAGS = 6
_H_LOSSES = 7
_H_PATH_BYTES = 8
_H_VERSION_BYTES = 9
_H_NAME_BYTES = 10
_H_DTYPE = 11
_H_NDIM = 12
_H_DATA_BYTES = 13
_H_LAYOUT = _H_WEIGHTS_FLAGS = 14
_H_WEIGHT_SET = 15
FORWARD_SLOTS = (_H_TOP_K, 8, 9, 10, 11, 12, 13, 14)
"""Header slots a FORWARD gives to the integer options, then to the inputs' dimensions."""
INPUT_FLAG_BASE = 16
"""Flag bit of ``INPUTS[0]`` being sent (the boolean options take the bits below)."""
CACHE_FLAG = 1 << 48  # FORWARD: a prefix-cache plan follows the inputs
WEIGHTS_FLAG_PARTIAL = 1 << 0

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""Element types of a WEIGHTS_TENSOR payload, by header code."""


class Command(enum.IntEnum):
    """What the workers do next."""

    FORWARD = 1
    SHUTDOWN = 2
    RELOAD = 3
    WEIGHTS_BEGIN = 4
    WEIGHTS_TENSOR = 5
    WEIGHTS_COMMIT = 6
    WEIGHTS_ABORT = 7
    ADAPTER = 8


WEIGHT_COMMANDS = tuple(Command(c) for c in range(Command.WEIGHTS_BEGIN, Command.ADAPTER))
STRING_COMMANDS = (Command.RELOAD, Command.ADAPTER)
"""Commands whose payload is two strings (a RELOAD's path and version; an ADAPTER's spec)."""


class ProtocolError(RuntimeError):
    """A worker received a header it cannot interpret; the ranks are out of step."""


class Extra(NamedTuple):
    """Non-batch fields of a received message.

    Attributes:
        step: the step id rank 0 sent.
        weight_set: FORWARD, RELOAD, WEIGHTS_BEGIN: the index of the weight set.
        path: RELOAD: checkpoint path ("" otherwise).
        version: RELOAD, WEIGHTS_COMMIT: weights version ("" otherwise).
        weights: WEIGHTS_*: the message (None otherwise).
    """

    step: int
    weight_set: int = 0
    path: str = ""
    version: str = ""
    weights: WeightsMessage | None = None


class WeightsMessage(NamedTuple):
    """One WEIGHTS_* message (rank 0 sends it with :func:`send_weights`).

    Attributes:
        names: WEIGHTS_BEGIN: name format code (``megascore.engine.weights.push.apply``).
        name: WEIGHTS_TENSOR: tensor name.
        tensor: WEIGHTS_TENSOR: on rank 0 the full tensor (host, one of
            ``WEIGHT_DTYPES``); on a worker a ``meta`` tensor of its shape and dtype
            (the worker's parts follow, :func:`recv_parts`).
        layout: WEIGHTS_TENSOR: layout code of the name (``engine.weights.push.apply``).
        version: WEIGHTS_COMMIT: the new weights version.
        partial: WEIGHTS_COMMIT: only the tensors sent are replaced.
        weight_set: WEIGHTS_BEGIN: the index of the weight set the push changes.
    """

    names: int = 0
    name: str = ""
    tensor: torch.Tensor | None = None
    layout: int = 0
    version: str = ""
    partial: bool = False
    weight_set: int = 0


class Received(NamedTuple):
    """One message as a worker sees it: ``command, batch, extra = recv_command(...)``."""

    command: Command
    batch: ScoreBatch | None
    extra: Extra


def _flag_options() -> list:
    """The boolean options, in flag-bit order."""
    return [opt for opt in schema.OPTIONS if opt.flag and opt.broadcast]


def _slot_options() -> list:
    """The integer options sent in header slots (``losses`` travels as its bitmask)."""
    return [
        opt for opt in schema.OPTIONS if not opt.flag and opt.broadcast and opt.name != "losses"
    ]


def _registry(loss_names: Sequence[str]) -> list[str]:
    names = sorted(set(loss_names))
    if len(names) > MAX_LOSSES:
        raise ValueError(f"at most {MAX_LOSSES} loss names fit the header, got {len(names)}")
    return names


def _header(
    command: Command, step: int, slots: dict[int, int] | None = None, weight_set: int = 0
) -> torch.Tensor:
    """int64 ``[HEADER_SLOTS]``: command, version, step, weight set, then ``slots``."""
    header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
    header[_H_COMMAND] = int(command)
    header[_H_VERSION] = PROTOCOL_VERSION
    header[_H_STEP] = step
    header[_H_WEIGHT_SET] = weight_set
    for index, value in (slots or {}).items():
        header[index] = value
    return header


def _bcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup) -> None:
    if dist.get_world_size(group) > 1:  # a one-rank replica has no one to tell
        dist.broadcast(tensor, src=src, group=group)


def _loss_bits(names: Sequence[str], registry: list[str]) -> int:
    unknown = sorted(set(names) - set(registry))
    if unknown:
        raise ValueError(f"unknown loss names {unknown}; registry is {registry}")
    return sum(1 << registry.index(name) for name in set(names))


def send_batch(
    batch: ScoreBatch,
    group: dist.ProcessGroup,
    src: int,
    loss_names: Sequence[str],
    *,
    device: torch.device | str,
    step: int = 0,
    weight_set: int = 0,
) -> None:
    """Rank ``src``: broadcasts a FORWARD header and the batch buffers.

    Args:
        batch: the batch to run.
        group: the group of ranks that run the model (required).
        src: global rank of the sender (this rank).
        loss_names: the loss registry (same on every rank).
        device: where the collective's tensors live (cpu for gloo, cuda for NCCL).
        step: step id for the workers' logs.
        weight_set: the index of the weight set the step runs on.

    Raises:
        ValueError: a loss outside the registry (before any collective). The batch
            itself was checked by :meth:`~megascore.api.types.ScoreBatch.check`.
    """
    registry = _registry(loss_names)
    slots = {_H_NUM_TOKENS: batch.num_tokens, _H_NUM_SEQUENCES: batch.num_sequences}
    slots[_H_LOSSES] = _loss_bits(batch.losses, registry)
    flags, free = 0, iter(FORWARD_SLOTS)
    for bit, opt in enumerate(_flag_options()):
        flags |= (1 << bit) if getattr(batch, opt.name) else 0
    for opt in _slot_options():
        slots[next(free)] = int(getattr(batch, opt.name))
    payloads = []
    for i, spec in enumerate(schema.INPUTS):
        value = getattr(batch, spec.name)
        dims = np.shape(value)[1:] if value is not None else (0,) * spec.ndim
        for dim in dims:
            slots[next(free)] = int(dim)
        if value is not None:
            flags |= 1 << (INPUT_FLAG_BASE + i)
            payloads.append(np.ascontiguousarray(value, dtype=spec.dtype).reshape(-1))
    if batch.cache_hits is not None:  # [B] hits, then the slots of every block
        flags |= CACHE_FLAG
        payloads += forward_payloads.cache_plan(batch)
    slots[_H_FLAGS] = flags
    # ids_and_lengths: [T + B], token ids then lengths, one collective for both.
    ids_and_lengths = np.concatenate(
        [batch.token_ids.astype(np.int64, copy=False), batch.lengths.astype(np.int64, copy=False)]
    )
    _bcast(_header(Command.FORWARD, step, slots, weight_set).to(device), src, group)
    _bcast(torch.from_numpy(ids_and_lengths).to(device), src, group)
    for payload in payloads:
        _bcast(torch.from_numpy(payload).to(device), src, group)
    logger.debug("step %d: sent FORWARD T=%d B=%d", step, batch.num_tokens, batch.num_sequences)


def send_command(
    command: Command,
    group: dist.ProcessGroup,
    src: int,
    *,
    device: torch.device | str,
    path: str = "",
    version: str = "",
    step: int = 0,
    weight_set: int = 0,
) -> None:
    """Rank ``src``: broadcasts a SHUTDOWN or RELOAD message.

    Args:
        command: ``Command.SHUTDOWN``, ``RELOAD`` or ``ADAPTER`` (FORWARD: :func:`send_batch`).
        group: the group of ranks that run the model (required).
        src: global rank of the sender (this rank).
        device: where the collective's tensors live.
        path, version: RELOAD: checkpoint path and weights version.
        step: step id for the workers' logs.
        weight_set: RELOAD: the index of the weight set it loads.

    Raises:
        ValueError: FORWARD, or an unknown command (before any collective).
    """
    command = Command(command)
    if command == Command.FORWARD:
        raise ValueError("send FORWARD with send_batch")
    if command == Command.SHUTDOWN:
        _bcast(_header(command, step).to(device), src, group)
        return
    path_bytes, version_bytes = path.encode("utf-8"), version.encode("utf-8")
    sizes = {_H_PATH_BYTES: len(path_bytes), _H_VERSION_BYTES: len(version_bytes)}
    header = _header(command, step, sizes, weight_set)
    _bcast(header.to(device), src, group)
    if path_bytes or version_bytes:
        payload = np.frombuffer(path_bytes + version_bytes, dtype=np.uint8).copy()
        _bcast(torch.from_numpy(payload).to(device), src, group)


def send_weights(
    command: Command,
    message: WeightsMessage,
    group: dist.ProcessGroup,
    src: int,
    *,
    device: torch.device | str,
    step: int = 0,
) -> None:
    """Rank ``src``: broadcasts one WEIGHTS_* message.

    Args:
        command: one of ``WEIGHT_COMMANDS``.
        message: its fields (those of other commands are ignored).
        group: the group of ranks that run the model (required).
        src: global rank of the sender (this rank).
        device: where the collective's tensors live.
        step: step id for the workers' logs.

    Raises:
        ValueError: another command, or a tensor of a dtype not in ``WEIGHT_DTYPES``
            (before any collective).
    """
    command = Command(command)
    if command not in WEIGHT_COMMANDS:
        raise ValueError(f"send {command.name} with send_batch / send_command")
    slots: dict[int, int] = {}
    payloads: list[torch.Tensor] = []
    if command == Command.WEIGHTS_BEGIN:
        slots[_H_LAYOUT] = message.names
    elif command == Command.WEIGHTS_TENSOR:
        tensor = message.tensor
        if tensor.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"tensor {message.name!r}: dtype {tensor.dtype} cannot be sent")
        name = message.name.encode("utf-8")
        slots.update(
            {
                _H_NAME_BYTES: len(name),
                _H_DTYPE: WEIGHT_DTYPES.index(tensor.dtype),
                _H_NDIM: tensor.dim(),
                _H_DATA_BYTES: tensor.numel() * tensor.element_size(),
                _H_LAYOUT: message.layout,
            }
        )
        if tensor.dim():
            payloads.append(torch.tensor(tensor.shape, dtype=torch.int64))
        payloads.append(torch.frombuffer(bytearray(name), dtype=torch.uint8))
    elif command == Command.WEIGHTS_COMMIT:
        version = message.version.encode("utf-8")
        slots[_H_VERSION_BYTES] = len(version)
        slots[_H_WEIGHTS_FLAGS] = WEIGHTS_FLAG_PARTIAL if message.partial else 0
        if version:
            payloads.append(torch.frombuffer(bytearray(version), dtype=torch.uint8))
    _bcast(_header(command, step, slots, message.weight_set).to(device), src, group)
    for payload in payloads:
        _bcast(payload.to(device), src, group)


def _recv_weights(command: Command, h: list[int], src, group, device) -> WeightsMessage:
    """Workers: the payload of a WEIGHTS_* message whose header is ``h``."""
    if command == Command.WEIGHTS_BEGIN:
        return WeightsMessage(names=h[_H_LAYOUT], weight_set=h[_H_WEIGHT_SET])
    if command == Command.WEIGHTS_ABORT:
        return WeightsMessage()
    if command == Command.WEIGHTS_COMMIT:
        version = b""
        if h[_H_VERSION_BYTES]:
            payload = torch.empty(h[_H_VERSION_BYTES], dtype=torch.uint8, device=device)
            _bcast(payload, src, group)
            version = payload.cpu().numpy().tobytes()
        partial = bool(h[_H_WEIGHTS_FLAGS] & WEIGHTS_FLAG_PARTIAL)
        return WeightsMessage(version=version.decode("utf-8"), partial=partial)
    if not 0 <= h[_H_DTYPE] < len(WEIGHT_DTYPES):
        raise ProtocolError(f"unknown weight dtype code {h[_H_DTYPE]}")
    shape: list[int] = []
    if h[_H_NDIM]:
        dims = torch.empty(h[_H_NDIM], dtype=torch.int64, device=device)
        _bcast(dims, src, group)
        shape = dims.cpu().tolist()
    name = torch.empty(h[_H_NAME_BYTES], dtype=torch.uint8, device=device)
    _bcast(name, src, group)
    tensor = torch.empty(shape, dtype=WEIGHT_DTYPES[h[_H_DTYPE]], device="meta")
    if tensor.numel() * tensor.element_size() != h[_H_DATA_BYTES]:
        raise ProtocolError(f"weight tensor of shape {shape}: {h[_H_DATA_BYTES]} bytes")
    return WeightsMessage(
        name=name.cpu().numpy().tobytes().decode("utf-8"), tensor=tensor, layout=h[_H_LAYOUT]
    )


def recv_command(
    group: dist.ProcessGroup,
    src: int,
    loss_names: Sequence[str],
    *,
    device: torch.device | str,
) -> Received:
    """Workers: receives the next message from rank ``src``.

    Args:
        group: the group of ranks that run the model (required).
        src: global rank of the sender.
        loss_names: the loss registry (same on every rank).
        device: where the collective's tensors live.

    Returns:
        ``(command, batch, extra)``: batch is a :class:`ScoreBatch` for FORWARD
        (numpy, on the host), None otherwise.

    Raises:
        ProtocolError: unknown command, protocol version or loss bit.
    """
    registry = _registry(loss_names)
    header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=device)
    _bcast(header, src, group)
    h = [int(x) for x in header.cpu().tolist()]
    if h[_H_VERSION] != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {h[_H_VERSION]} != {PROTOCOL_VERSION}")
    try:
        command = Command(h[_H_COMMAND])
    except ValueError as e:
        raise ProtocolError(f"unknown command {h[_H_COMMAND]}") from e
    if min(h[_H_NUM_TOKENS], h[_H_NUM_SEQUENCES], *h[_H_PATH_BYTES : _H_DATA_BYTES + 1]) < 0:
        raise ProtocolError(f"negative size in header {h}")
    extra = Extra(step=h[_H_STEP], weight_set=h[_H_WEIGHT_SET])
    if command == Command.SHUTDOWN:
        return Received(command, None, extra)
    if command in WEIGHT_COMMANDS:
        weights = _recv_weights(command, h, src, group, device)
        return Received(command, None, extra._replace(version=weights.version, weights=weights))
    if command in STRING_COMMANDS:
        n_path, n_version = h[_H_PATH_BYTES], h[_H_VERSION_BYTES]
        raw = b""
        if n_path + n_version:
            payload = torch.empty(n_path + n_version, dtype=torch.uint8, device=device)
            _bcast(payload, src, group)
            raw = payload.cpu().numpy().tobytes()
        path, version = raw[:n_path].decode("utf-8"), raw[n_path:].decode("utf-8")
        return Received(command, None, extra._replace(path=path, version=version))

    num_tokens, num_sequences, flags = h[_H_NUM_TOKENS], h[_H_NUM_SEQUENCES], h[_H_FLAGS]
    if h[_H_LOSSES] >> len(registry):
        raise ProtocolError(f"loss bitmask {h[_H_LOSSES]:#x} exceeds the registry {registry}")
    ids_and_lengths = torch.empty(num_tokens + num_sequences, dtype=torch.int64, device=device)
    _bcast(ids_and_lengths, src, group)
    bcast = functools.partial(_bcast, src=src, group=group)
    ids_and_lengths_np = ids_and_lengths.cpu().numpy()
    fields = {
        "token_ids": ids_and_lengths_np[:num_tokens],
        "lengths": ids_and_lengths_np[num_tokens:],
        "losses": tuple(name for i, name in enumerate(registry) if h[_H_LOSSES] >> i & 1),
    }
    free = iter(FORWARD_SLOTS)
    for bit, opt in enumerate(_flag_options()):
        fields[opt.name] = bool(flags >> bit & 1)
    for opt in _slot_options():
        fields[opt.name] = h[next(free)]
    for i, spec in enumerate(schema.INPUTS):
        dims = tuple(h[next(free)] for _ in range(spec.ndim))
        rows = num_tokens if spec.per == schema.TOKEN else num_sequences
        sent = flags >> (INPUT_FLAG_BASE + i) & 1
        fields[spec.name] = (
            forward_payloads.receive_input(spec, (rows, *dims), bcast, device) if sent else None
        )
    if flags & CACHE_FLAG:
        plan = forward_payloads.receive_cache_plan(num_sequences, bcast, device)
        fields["cache_hits"], fields["cache_slots"], fields["cache_moves"] = plan
    batch = ScoreBatch(**fields)
    logger.debug("step %d: received FORWARD T=%d B=%d", extra.step, num_tokens, num_sequences)
    return Received(command, batch, extra)
