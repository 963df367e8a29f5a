"""Prefix affinity: which replica a Score request goes to (``load_balancing="prefix"``).

A replica keeps the keys/values of the sequence prefixes it scored (blocks of 64 tokens
aligned at the sequence start), so a request whose sequences begin like an earlier
one's computes only the rest, on the replica that scored the earlier one. With
``load_balancing="prefix"`` the client opens one channel per replica of its target
(each address of ``ipv4:a,b``, each address a ``dns:///`` name resolves to when the
client opens) and sends each Score request to the replica its **prefix key** names:

* **Key** (:func:`prefix_key`): the first ``prefix_key_tokens`` (default
  :data:`PREFIX_KEY_TOKENS`, 256) token ids of the request's *first* sequence, or all of
  it when shorter, as little-endian int64, hashed with BLAKE2b to 8 bytes (16 hex
  digits). Requests whose first sequences share their first N tokens get one key: the
  turns of one conversation, the responses of one GRPO prompt sent one per request, the
  choices of one eval context. Two related requests get different keys only when one
  of them is shorter than N, so their shared prefix is under N tokens: a miss costs at
  most N tokens of recompute. N above the prompt every request shares (a system prompt,
  a few-shot header) keeps unrelated requests apart.
* **Replica** (:func:`rendezvous_order`): rendezvous (highest-random-weight) hashing:
  every replica gets the weight ``BLAKE2b(key | replica address)``, the heaviest is
  preferred, the others follow in weight order. Adding or removing a replica moves
  only the keys it gains or held (about 1/n of them), never keys between the others.
* **Load** (:meth:`ReplicaRouter.pick`): the request goes to the first replica in that
  order that is not *overloaded*: more calls of this client in flight than
  :data:`SPILL_FACTOR` (2) times those of its least loaded replica *and* at least
  :data:`SPILL_MARGIN` (4) more. A key that spills goes to its second choice, so even
  spilled requests of one prefix meet on few replicas.
* **Failures**: a replica whose call ended UNAVAILABLE (or CANCELLED by the server) is
  skipped for :data:`DOWN_S` seconds (unless every replica is), and the request goes at
  once to the next replica in its order, up to the retry policy's ``max_attempts``
  attempts (then the policy's backoff when every replica was tried, and
  ``wait_for_server_s`` after that, as without routing). A request pinned to a weights
  version and refused by a replica goes to the next one as well.

The key also travels as the :data:`PREFIX_KEY_HEADER` metadata of every Score call
(with any ``load_balancing``), so a proxy can ring-hash on it (docs/deploy.md,
"Prefix affinity"). The in-flight counts are this client's own calls: clients do not
see each other's load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import threading
import time
from collections.abc import Sequence

import grpc
import numpy as np

from megascore_client.channel import RetryPolicy
from megascore_client.errors import ScoringError

__all__ = [
    "DOWN_S",
    "PREFIX_KEY_HEADER",
    "PREFIX_KEY_TOKENS",
    "SPILL_FACTOR",
    "SPILL_MARGIN",
    "ReplicaRouter",
    "prefix_key",
    "rendezvous_order",
]

PREFIX_KEY_TOKENS = 256
"""Default number of leading tokens of a request's first sequence that make its key."""
PREFIX_KEY_HEADER = "x-megascore-prefix-key"
"""The metadata (HTTP/2 header) of a Score call holding its key (16 hex digits)."""
SPILL_FACTOR = 2
SPILL_MARGIN = 4
"""A replica is overloaded with more than ``SPILL_FACTOR`` x the in-flight calls of the
least loaded one and at least ``SPILL_MARGIN`` more."""
DOWN_S = 5.0
"""Seconds a replica whose call failed UNAVAILABLE is skipped."""
FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def prefix_key(token_ids, lengths, tokens: int = PREFIX_KEY_TOKENS) -> str:
    """The prefix key of a request: its first sequence's first ``tokens`` ids.

    Args:
        token_ids: the request's token ids, sequences concatenated (wire layout).
        lengths: the sequences' lengths (the first is used).
        tokens: how many leading tokens make the key.

    Returns:
        16 hex digits: BLAKE2b (8-byte digest) of those ids as little-endian int64.
    """
    first = np.asarray(token_ids[: min(tokens, int(lengths[0]))], dtype="<i8")
    return hashlib.blake2b(first.tobytes(), digest_size=8).hexdigest()


def _weight(key: str, replica: str) -> int:
    digest = hashlib.blake2b(f"{key}|{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(key: str, replicas: Sequence[str]) -> list[int]:
    """The indices of ``replicas`` in ``key``'s preference order (heaviest weight first)."""
    weights = [_weight(key, replica) for replica in replicas]
    return sorted(range(len(replicas)), key=lambda i: (-weights[i], replicas[i]))


def overloaded(in_flight: int, least: int) -> bool:
    """Whether a replica with ``in_flight`` calls is overloaded next to ``least``."""
    return in_flight > SPILL_FACTOR * least and in_flight - least >= SPILL_MARGIN


def failover_code(error: ScoringError) -> bool:
    """A failure that sends the request to another replica (and marks this one down)."""
    return error.code in FAILOVER_CODES


def backoff_s(policy: RetryPolicy, retry: int) -> float:
    """The ``retry``-th (1-based) backoff of ``policy``, +-20 % like gRPC's."""
    base = policy.initial_backoff_s * policy.backoff_multiplier ** (retry - 1)
    return min(base, policy.max_backoff_s) * random.uniform(0.8, 1.2)


@dataclasses.dataclass
class Resend:
    """The re-send state of one Score request (see ``ClientBase._before_resend``).

    Attributes:
        attempts: attempts made since the last wait of the re-send schedule.
        backoffs: backoffs slept since then (every replica tried).
        avoid: replicas that failed this request (skipped while another is left).
        schedule: the ``wait_for_server_s`` / pin schedule, once started.
    """

    attempts: int = 1
    backoffs: int = 0
    avoid: set = dataclasses.field(default_factory=set)
    schedule: object = None


class ReplicaRouter:
    """Picks replicas for keys: preference order, this client's load, down marks.

    Thread-safe (the sync client's threads share it; the asyncio client calls it from
    its event loop).

    Args:
        replicas: the replicas' addresses (their names in the hash).
        clock: ``time.monotonic`` (tests pass their own).
    """

    def __init__(self, replicas: Sequence[str], *, clock=time.monotonic):
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = list(replicas)
        self.in_flight = [0] * len(self.replicas)
        self._down_until = [0.0] * len(self.replicas)
        self._clock = clock
        self._lock = threading.Lock()

    def down(self, index: int) -> bool:
        """Whether replica ``index`` failed within the last :data:`DOWN_S` seconds."""
        return self._down_until[index] > self._clock()

    def pick(self, key: str, avoid=frozenset()) -> int:
        """The replica for a call with ``key`` (counted in flight until :meth:`release`).

        Candidates: the replicas in ``key``'s order that are neither down nor in
        ``avoid``; when none, those not in ``avoid``; then those not down; then all.
        Among them, the first that is not overloaded next to the least loaded one.
        """
        order = rendezvous_order(key, self.replicas)
        with self._lock:
            candidates = (
                [i for i in order if i not in avoid and not self.down(i)]
                or [i for i in order if i not in avoid]
                or [i for i in order if not self.down(i)]
                or order
            )
            least = min(self.in_flight[i] for i in candidates)
            index = next(i for i in candidates if not overloaded(self.in_flight[i], least))
            self.in_flight[index] += 1
        return index

    def release(self, index: int, error: ScoringError | None = None) -> None:
        """A call on replica ``index`` ended (``error``: how it failed; a failover code
        marks the replica down, an answer marks it up)."""
        with self._lock:
            self.in_flight[index] -= 1
            if error is None:
                self._down_until[index] = 0.0
            elif failover_code(error):
                self._down_until[index] = self._clock() + DOWN_S

    def untried(self, avoid) -> bool:
        """Whether a replica outside ``avoid`` is left."""
        return len(set(avoid)) < len(self.replicas)
