"""Codes, reasons and states of the wire protocol (:mod:`loraflow.common.protocol`), as ``enum.StrEnum``.

Typed in the code, plain strings on the wire, the same strings as ever: a raw msgpack client sends
``"stop"`` and reads ``"malformed"``, and a member compares equal to its string. msgspec refuses any other
value at decode.
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    WORKER = "worker"
    LEARNER = "learner"
    OBSERVER = "observer"


class ErrorCode(enum.StrEnum):
    MALFORMED = "malformed"  # framing or field validation failed
    PROTOCOL_VERSION = "protocol_version"  # preamble carries another protocol version
    OVERSIZE = "oversize"  # message larger than broker.max_message_bytes
    INVALID_GROUP = "invalid_group"  # a rollout group's contents are out of range (NaN log-prob, token id, versions)
    UNKNOWN_LEASE = "unknown_lease"  # a lease never granted to the sender for that prompt (its own expired ones count)
    UNKNOWN_BATCH = "unknown_batch"
    NOT_REGISTERED = "not_registered"  # a message that needs a hello first
    FORBIDDEN = "forbidden"  # the sender's role may not send this message
    LIMIT = "limit"  # too many workers, leases or bytes
    STALE_VERSION = "stale_version"  # an adapter version that does not advance the latest one
    REPLACED = "replaced"  # a learner replaced by another learner process: it must stop (two never train one run)
    INTERNAL = "internal"
    UNKNOWN_RUN = "unknown_run"  # a Hello or StatsRequest naming a run the pool broker does not hold
    INVALID_RUN = "invalid_run"  # a RunSubmit the pool refuses (a pool-owned key, a bad value, an id in use)
    QUARANTINED = "quarantined"  # a worker whose rollouts failed the learner's policy check (common/integrity.py)


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TURN_LIMIT = "turn_limit"


class ClientState(enum.StrEnum):
    STARTING = "starting"
    IDLE = "idle"
    WAITING = "waiting"
    GENERATING = "generating"
    SCORING = "scoring"
    TRAINING = "training"
    PUBLISHING = "publishing"
    STOPPING = "stopping"


class GrantReason(enum.StrEnum):
    """Why a LeaseGrant granted nothing (or less than asked)."""

    NONE = ""
    BACKPRESSURE = "backpressure"
    STALE_ADAPTER = "stale_adapter"
    NO_PROMPTS = "no_prompts"
    DRAINING = "draining"
    LIMIT = "limit"
    QUARANTINED = "quarantined"


class AckStatus(enum.StrEnum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"


class EngineDtype(enum.StrEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class MismatchReason(enum.StrEnum):
    """Why the learner's policy check failed a group (common/integrity.py)."""

    LOGPROBS = "logprobs"
    ADAPTER_SHA256 = "adapter_sha256"
    LORA_ID_REUSED = "lora_id_reused"
    NO_EVIDENCE = "no_evidence"


ROLES = tuple(Role)
ERROR_CODES = tuple(ErrorCode)
FINISH_REASONS = tuple(FinishReason)
CLIENT_STATES = tuple(ClientState)
ENGINE_DTYPES = tuple(EngineDtype)
MISMATCH_REASONS = tuple(MismatchReason)


class ProtocolError(ValueError):
    """A message is malformed; ``code`` is the Error code to answer with."""

    def __init__(self, message: str, code: str = ErrorCode.MALFORMED) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
