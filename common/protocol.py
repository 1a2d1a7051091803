"""The wire protocol: message kinds, typed message records and their validating encode/decode.

Who sends what (all through the broker's one ROUTER socket; clients use DEALER sockets)::

    worker  -> broker   Hello, Heartbeat, LeaseRequest, RolloutGroup, LeaseReturn, AdapterFetch, Bye
    broker  -> worker   Welcome, Heartbeat (pong), LeaseGrant, Ack(group, or several: ref_ids), AdapterNotice,
                        AdapterUpdate, Error
    learner -> broker   Hello, Heartbeat, AdapterUpdate (publish), BatchRequest, BatchAck, Bye
    broker  -> learner  Welcome, Heartbeat (pong), Ack(adapter), Batch, Error
    anyone  -> broker   StatsRequest  ->  Stats

Every record is a ``@dataclass(slots=True, kw_only=True)`` validated field by field on decode (see
:mod:`common.schema`): wrong types, missing or unknown fields and out-of-range values raise
:class:`ProtocolError` naming the field. Messages with tensors (RolloutGroup, AdapterUpdate, Batch) also check
that the tensor frames have the names, dtypes and shapes the header implies. Contents of tensors (finite
log-probs, token ids in range) are checked by :func:`check_group_values`, which only reads numpy views.

Everything a peer sends is bounded at decode, so nothing it sends can fail later where it is re-encoded or
shown: ``Heartbeat.counters`` and ``RolloutGroup.metrics`` hold at most 64 finite numbers under names of at most
64 characters; other free-form values (``meta``, ``columns``, ``prompt_messages``, ``adapter_config``) nest at
most :data:`common.schema.MAX_DEPTH` levels; every policy version is at most :data:`MAX_VERSION` (tokens carry
versions as int32). A lease id is bound to the worker it was granted to (``broker.leases``); with security off a
learner's Hello carries the run token (``Hello.token``, :mod:`common.run_token`).

Compatibility: new fields are appended with defaults. An incompatible change bumps ``PROTOCOL_VERSION``; every
message carries it in its preamble and a mismatch is refused with an Error naming both versions.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from common import framing
from common.framing import Envelope, FramingError, TensorSpec
from common.schema import SchemaError, build, dump, rule

PROTOCOL_VERSION = 1

MAX_ID_LEN = 128
MAX_RENEWED_LEASES = 1024  # lease ids one Heartbeat may renew (broker.max_leases_per_worker is far below)
MAX_TEXT_LEN = 1 << 20
MAX_GROUP_SIZE = 1024
MAX_BATCH_GROUPS = 4096
MAX_MESSAGES = 4096
MAX_REWARD_FUNCTIONS = 64
MAX_COUNTERS = 64  # entries of Heartbeat.counters and RolloutGroup.metrics
MAX_SERVED = 64  # RolloutGroup.served entries: distinct versions in one group's tokens
#: policy versions travel as int32 in the token ``versions`` tensor: no version may exceed this
MAX_VERSION = (1 << 31) - 1


class ProtocolError(ValueError):
    """A message is malformed; ``code`` is the Error code to answer with."""

    def __init__(self, message: str, code: str = "malformed") -> None:
        super().__init__(message)
        self.code = code


class Kind(enum.IntEnum):
    HELLO = 1
    WELCOME = 2
    HEARTBEAT = 3
    ERROR = 4
    BYE = 5
    LEASE_REQUEST = 10
    LEASE_GRANT = 11
    LEASE_RETURN = 12
    ROLLOUT_GROUP = 20
    ACK = 21
    ADAPTER_UPDATE = 30
    ADAPTER_NOTICE = 31
    ADAPTER_FETCH = 32
    BATCH_REQUEST = 40
    BATCH = 41
    BATCH_ACK = 42
    STATS_REQUEST = 50
    STATS = 51


KNOWN_KINDS = frozenset(int(k) for k in Kind)
ROLES = ("worker", "learner", "observer")
ERROR_CODES = (
    "malformed",  # framing or field validation failed
    "protocol_version",  # preamble carries another protocol version
    "oversize",  # message larger than broker.max_message_bytes
    "invalid_group",  # a rollout group's contents are out of range (NaN log-prob, token id, versions)
    "unknown_lease",  # a lease never granted to the sender for that prompt (its own expired ones still count)
    "unknown_batch",
    "not_registered",  # a message that needs a hello first
    "forbidden",  # the sender's role may not send this message
    "limit",  # too many workers, leases or bytes
    "stale_version",  # an adapter version that does not advance the latest one
    "replaced",  # a learner replaced by another learner process: it must stop (two never train one run)
    "internal",
    "quarantined",  # a worker whose rollouts failed the learner's policy check (common/integrity.py)
)
FINISH_REASONS = ("stop", "length", "abort", "error", "turn_limit")
CLIENT_STATES = ("starting", "idle", "waiting", "generating", "scoring", "training", "publishing", "stopping")
GRANT_REASONS = ("", "backpressure", "stale_adapter", "no_prompts", "draining", "limit", "quarantined")
ACK_STATUSES = ("accepted", "duplicate")
ENGINE_DTYPES = ("float32", "bfloat16", "float16")
#: why the learner's policy check failed a group (common/integrity.py)
MISMATCH_REASONS = ("logprobs", "adapter_sha256", "lora_id_reused", "no_evidence")


# -- records -------------------------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Hello:
    KIND: ClassVar[Kind] = Kind.HELLO
    role: str = rule(choices=ROLES, doc="what the client is")
    client_id: str = rule(max_len=MAX_ID_LEN, doc="stable name of the client (worker id, 'learner')")
    backend: str = rule("", max_len=64, doc="generation backend of a worker")
    capacity: int = rule(1, ge=1, le=1024, doc="leases a worker can hold at once")
    adapter_version: int = rule(0, ge=0, le=MAX_VERSION, doc="policy version the client holds")
    host: str = rule("", max_len=256)
    pid: int = rule(0, ge=0)
    session: str = rule("", max_len=MAX_ID_LEN, doc="random per process start: a new session of a known id "
                        "means the old process died and its leases are reclaimed")
    batched_acks: bool = rule(False, doc="the client reads Ack.ref_ids, so the broker may acknowledge several "
                              "rollout groups in one Ack")
    token: str = rule("", max_len=128, doc="the run token a learner presents when security is off "
                      "(common/run_token.py); other roles send none")


@dataclass(slots=True, kw_only=True)
class Welcome:
    KIND: ClassVar[Kind] = Kind.WELCOME
    broker_id: str = rule(max_len=MAX_ID_LEN, doc="random per broker start: a new id means the broker restarted")
    latest_version: int = rule(ge=0, le=MAX_VERSION)
    group_size: int = rule(ge=1, le=MAX_GROUP_SIZE)
    groups_per_step: int = rule(ge=1, le=MAX_BATCH_GROUPS)
    max_staleness: int = rule(ge=0)
    heartbeat_interval_s: float = rule(gt=0)
    heartbeat_timeout_s: float = rule(gt=0)
    lease_timeout_s: float = rule(gt=0)
    max_message_bytes: int = rule(ge=1)
    vocab_size: int = rule(0, ge=0, doc="token ids must be below this; 0 = not checked")


@dataclass(slots=True, kw_only=True)
class Heartbeat:
    KIND: ClassVar[Kind] = Kind.HEARTBEAT
    adapter_version: int = rule(0, ge=0, le=MAX_VERSION)
    latest_version: int = rule(0, ge=0, le=MAX_VERSION, doc="set by the broker in its pong")
    state: str = rule("idle", choices=CLIENT_STATES)
    num_leases: int = rule(0, ge=0)
    counters: dict[str, int | float] = rule(default_factory=dict, max_len=MAX_COUNTERS,
                                            doc="cumulative client counters for stats: numbers under names of at "
                                            "most 64 characters (common.schema.MAX_KEY_LEN)")
    lease_ids: list[str] = rule(default_factory=list, max_len=MAX_RENEWED_LEASES,
                                doc="leases the worker is still working on: the broker renews those it holds for "
                                "broker.lease_timeout_s from now (a long generation is never generated twice)")


@dataclass(slots=True, kw_only=True)
class Error:
    KIND: ClassVar[Kind] = Kind.ERROR
    code: str = rule(choices=ERROR_CODES)
    message: str = rule(max_len=4000)
    ref_kind: int = rule(0, ge=0, doc="kind of the message this answers")
    ref_id: str = rule("", max_len=MAX_ID_LEN)


@dataclass(slots=True, kw_only=True)
class Bye:
    KIND: ClassVar[Kind] = Kind.BYE
    reason: str = rule("", max_len=256)


@dataclass(slots=True, kw_only=True)
class LeaseRequest:
    KIND: ClassVar[Kind] = Kind.LEASE_REQUEST
    max_leases: int = rule(1, ge=1, le=1024)
    adapter_version: int = rule(0, ge=0, le=MAX_VERSION)
    wait_ms: int = rule(1000, ge=0, le=600_000, doc="long-poll: answer within this time even if nothing is granted")


@dataclass(slots=True, kw_only=True)
class PromptLease:
    lease_id: str = rule(max_len=MAX_ID_LEN)
    group_id: str = rule(max_len=MAX_ID_LEN, doc="stable per (epoch, prompt): the dedup key")
    prompt_index: int = rule(ge=0)
    epoch: int = rule(ge=0)
    task: str = rule(max_len=128)
    prompt: str = rule(max_len=MAX_TEXT_LEN)
    answer: str = rule("", max_len=MAX_TEXT_LEN)
    meta: dict[str, Any] = rule(default_factory=dict, max_len=256)
    group_size: int = rule(ge=1, le=MAX_GROUP_SIZE)
    deadline_s: float = rule(gt=0, unit="s", doc="time from grant until the lease is reclaimed")
    prompt_messages: list[dict[str, Any]] | None = rule(None, max_len=MAX_MESSAGES,
                                                        doc="a conversational prompt ([{role, content}], TRL's "
                                                        "format); then ``prompt`` is empty. None: ``prompt`` is it")
    columns: dict[str, Any] | None = rule(None, max_len=256, doc="the dataset row's other columns: the reward "
                                          "functions' keyword arguments (see common/dataset.py)")

    @property
    def prompt_value(self) -> str | list[dict[str, Any]]:
        """The prompt as the dataset has it: the text, or the list of messages."""
        return self.prompt_messages if self.prompt_messages is not None else self.prompt


@dataclass(slots=True, kw_only=True)
class LeaseGrant:
    KIND: ClassVar[Kind] = Kind.LEASE_GRANT
    leases: list[PromptLease] = rule(default_factory=list, max_len=1024)
    reason: str = rule("", choices=GRANT_REASONS, doc="why nothing (or less) was granted")
    latest_version: int = rule(0, ge=0, le=MAX_VERSION)


@dataclass(slots=True, kw_only=True)
class LeaseReturn:
    KIND: ClassVar[Kind] = Kind.LEASE_RETURN
    lease_ids: list[str] = rule(max_len=1024)
    reason: str = rule("", max_len=256)


#: tensors of a rollout group: name -> (dtype, which length list sizes it)
GROUP_TENSORS: dict[str, tuple[str, str]] = {
    "prompt_ids": ("int32", "prompt_lens"),
    "completion_ids": ("int32", "completion_lens"),
    "logprobs": ("float32", "completion_lens"),
    "versions": ("int32", "completion_lens"),
    "loss_mask": ("uint8", "completion_lens"),
}
GROUP_TENSORS_DTYPES = frozenset(dtype for dtype, _ in GROUP_TENSORS.values())


@dataclass(slots=True, kw_only=True)
class ServedAdapter:
    """What the engine served one policy version with, as the engine reports it (the evidence of
    :mod:`common.integrity`): read back from the engine after the load, never copied from what the worker meant
    to load. v0, the base model, is ``adapter=""``, ``lora_id=0``, ``sha256=""``."""

    version: int = rule(ge=0, le=MAX_VERSION)
    adapter: str = rule("", max_len=128, doc="the engine's name for the adapter (vLLM lora_name, hf peft slot)")
    lora_id: int = rule(0, ge=0, le=MAX_VERSION, doc="the engine's int id of the loaded weights (vLLM lora_int_id, "
                        "hf load number): one id never names two versions in one worker process")
    sha256: str = rule("", max_len=64, doc="sha256 of the tensor bytes the engine loaded, computed as "
                       "AdapterUpdate.sha256 (common.framing.frames_sha256 in the published tensor order)")
    dtype: str = rule("float32", choices=ENGINE_DTYPES, doc="the engine's compute dtype (sets the tolerance)")


@dataclass(slots=True, kw_only=True)
class RolloutGroup:
    """One prompt x group_size samples. Per-sample token arrays are concatenated in sample order.

    ``completion_*`` covers everything after the prompt: generated tokens (loss_mask 1) and, in multi-turn
    tasks, environment tokens (loss_mask 0, logprob 0). ``logprobs`` are the behaviour policy's log-probs of the
    sampled tokens (see :mod:`common.logprobs`); ``versions`` the policy version that produced each token.
    """

    KIND: ClassVar[Kind] = Kind.ROLLOUT_GROUP
    group_id: str = rule(max_len=MAX_ID_LEN)
    lease_id: str = rule(max_len=MAX_ID_LEN)
    worker_id: str = rule(max_len=MAX_ID_LEN)
    task: str = rule("", max_len=128)
    prompt_lens: list[int] = rule(max_len=MAX_GROUP_SIZE)
    completion_lens: list[int] = rule(max_len=MAX_GROUP_SIZE)
    rewards: list[float] = rule(max_len=MAX_GROUP_SIZE)
    finish_reasons: list[str] = rule(max_len=MAX_GROUP_SIZE, choices=FINISH_REASONS)
    min_version: int = rule(ge=0, le=MAX_VERSION, doc="oldest policy version of any generated token")
    max_version: int = rule(ge=0, le=MAX_VERSION)
    generate_s: float = rule(0.0, ge=0, unit="s")
    reward_s: float = rule(0.0, ge=0, unit="s")
    created_unix: float = rule(0.0, ge=0, unit="s")
    num_reward_failures: int = rule(0, ge=0)
    metrics: dict[str, int | float] = rule(default_factory=dict, max_len=MAX_COUNTERS,
                                           doc="finite numbers under names of at most 64 characters")
    reward_means: dict[str, Any] | None = rule(None, max_len=MAX_REWARD_FUNCTIONS,
                                               doc="reward function name -> its mean over the samples it applied "
                                               "to (finite numbers; a function that applied to none is absent)")
    served: list[ServedAdapter] = rule(default_factory=list, max_len=MAX_SERVED,
                                       doc="one entry per distinct version in ``versions``: the adapter the engine "
                                       "served it with (checked by the learner, common/integrity.py)")
    worker_session: str = rule("", max_len=MAX_ID_LEN, doc="set by the broker in a Batch: the Hello session of the "
                               "process that submitted the group (whatever a worker puts here is replaced, and "
                               "so is worker_id, by the id that process said Hello with)")

    @property
    def num_samples(self) -> int:
        return len(self.rewards)


def reward_means_of(groups: Sequence[RolloutGroup]) -> dict[str, float]:
    """Each reward function's mean over these groups (of its per-group means), for the learner's step metrics."""
    sums: dict[str, list[float]] = {}
    for group in groups:
        for name, mean in (group.reward_means or {}).items():
            sums.setdefault(name, []).append(float(mean))
    return {name: sum(values) / len(values) for name, values in sums.items()}


@dataclass(slots=True, kw_only=True)
class Ack:
    KIND: ClassVar[Kind] = Kind.ACK
    ref_kind: int = rule(ge=0, doc="kind of the acknowledged message")
    ref_id: str = rule(max_len=MAX_ID_LEN, doc="group id or adapter version")
    status: str = rule("accepted", choices=ACK_STATUSES)
    ref_ids: list[str] | None = rule(None, max_len=MAX_BATCH_GROUPS, doc="more ids this Ack acknowledges, with the "
                                     "same ref_kind and status (sent only to clients that said "
                                     "Hello(batched_acks=True)); None: ref_id alone")

    @property
    def ids(self) -> list[str]:
        """Every id this Ack acknowledges: ref_id, then ref_ids."""
        return [self.ref_id, *self.ref_ids] if self.ref_ids else [self.ref_id]


@dataclass(slots=True, kw_only=True)
class AdapterUpdate:
    """A LoRA adapter version; tensors carry PEFT state-dict names. sha256 covers the tensor bytes in order."""

    KIND: ClassVar[Kind] = Kind.ADAPTER_UPDATE
    version: int = rule(ge=1, le=MAX_VERSION)
    step: int = rule(0, ge=0)
    sha256: str = rule(max_len=64)
    adapter_config: dict[str, Any] = rule(max_len=256, doc="PEFT adapter_config.json contents")
    base_model: str = rule("", max_len=4096)
    created_unix: float = rule(0.0, ge=0)


@dataclass(slots=True, kw_only=True)
class AdapterNotice:
    KIND: ClassVar[Kind] = Kind.ADAPTER_NOTICE
    version: int = rule(ge=1, le=MAX_VERSION)
    num_bytes: int = rule(ge=0)
    sha256: str = rule(max_len=64)


@dataclass(slots=True, kw_only=True)
class AdapterFetch:
    KIND: ClassVar[Kind] = Kind.ADAPTER_FETCH
    version: int = rule(0, ge=0, le=MAX_VERSION, doc="0 = the newest")


@dataclass(slots=True, kw_only=True)
class BatchRequest:
    KIND: ClassVar[Kind] = Kind.BATCH_REQUEST
    num_groups: int = rule(ge=1, le=MAX_BATCH_GROUPS)
    wait_ms: int = rule(1000, ge=0, le=600_000)
    learner_version: int = rule(0, ge=0, le=MAX_VERSION)


@dataclass(slots=True, kw_only=True)
class BatchEntry:
    group: RolloutGroup
    first_tensor: int = rule(ge=0, doc="index of the group's first tensor spec in the batch")


@dataclass(slots=True, kw_only=True)
class Batch:
    """Whole groups for one learner step; empty when the long-poll timed out."""

    KIND: ClassVar[Kind] = Kind.BATCH
    batch_id: str = rule("", max_len=MAX_ID_LEN)
    groups: list[BatchEntry] = rule(default_factory=list, max_len=MAX_BATCH_GROUPS)
    latest_version: int = rule(0, ge=0, le=MAX_VERSION)


@dataclass(slots=True, kw_only=True)
class BatchAck:
    KIND: ClassVar[Kind] = Kind.BATCH_ACK
    batch_id: str = rule(max_len=MAX_ID_LEN)
    step: int = rule(ge=0)
    trained_version: int = rule(ge=0, le=MAX_VERSION, doc="policy version of the parameters the step updated")
    group_ids: list[str] = rule(default_factory=list, max_len=MAX_BATCH_GROUPS,
                                doc="exactly the groups done with (trained, or already trained): served groups not "
                                "listed are re-queued; lets a restarted broker recognise a batch it never served")
    checkpoint_version: int = rule(0, ge=0, le=MAX_VERSION,
                                   doc="newest version covered by a durable learner checkpoint")
    mismatches: list[PolicyMismatch] = rule(default_factory=list, max_len=MAX_BATCH_GROUPS,
                                            doc="groups of the batch that failed the policy check: not trained, "
                                            "not listed in group_ids (so re-queued); the broker counts them "
                                            "against the worker that sent them")


@dataclass(slots=True, kw_only=True)
class PolicyMismatch:
    """One group the learner refused to train because its tokens are not what the version it claims generates."""

    group_id: str = rule(max_len=MAX_ID_LEN)
    worker_id: str = rule("", max_len=MAX_ID_LEN, doc="as the group says; the broker uses its own record")
    reason: str = rule(choices=MISMATCH_REASONS)
    version: int = rule(0, ge=0, le=MAX_VERSION, doc="the claimed version that failed")
    num_checked: int = rule(0, ge=0, doc="tokens compared")
    num_off: int = rule(0, ge=0, doc="tokens off by more than the tolerance")
    max_abs_diff: float = rule(0.0, ge=0, doc="largest |behaviour - recomputed| log-prob (nats)")
    mean_abs_diff: float = rule(0.0, ge=0, doc="mean |behaviour - recomputed| log-prob (nats)")
    detail: str = rule("", max_len=512)


@dataclass(slots=True, kw_only=True)
class StatsRequest:
    KIND: ClassVar[Kind] = Kind.STATS_REQUEST


@dataclass(slots=True, kw_only=True)
class Stats:
    KIND: ClassVar[Kind] = Kind.STATS
    snapshot: dict[str, Any] = rule(default_factory=dict)


MESSAGES: dict[int, type] = {
    int(cls.KIND): cls
    for cls in (Hello, Welcome, Heartbeat, Error, Bye, LeaseRequest, LeaseGrant, LeaseReturn, RolloutGroup, Ack,
                AdapterUpdate, AdapterNotice, AdapterFetch, BatchRequest, Batch, BatchAck, StatsRequest, Stats)
}
assert set(MESSAGES) == KNOWN_KINDS


# -- encode / decode -----------------------------------------------------------------------------------------


def encode(message: Any, tensors: Sequence[tuple[str, Any]] = ()) -> list[Any]:
    """Frames of a message record plus its tensors ((name, array) pairs, sent zero-copy)."""
    return framing.pack(int(message.KIND), PROTOCOL_VERSION, dump(message), tensors)


def encode_with_frames(message: Any, specs: Sequence[TensorSpec], frames: Sequence[Any]) -> list[Any]:
    """Frames of a message whose tensor frames were received earlier and are forwarded untouched."""
    return framing.pack_raw(int(message.KIND), PROTOCOL_VERSION, dump(message), specs, frames)


def decode_envelope(frames: Sequence[Any], max_bytes: int) -> Envelope:
    """Framing checks only (preamble, version, size, header, tensor frame sizes)."""
    try:
        return framing.unpack(frames, version=PROTOCOL_VERSION, known_kinds=KNOWN_KINDS, max_bytes=max_bytes)
    except framing.VersionMismatch as exc:
        raise ProtocolError(str(exc), code="protocol_version") from None
    except FramingError as exc:
        code = "oversize" if "exceeds the limit" in str(exc) else "malformed"
        raise ProtocolError(str(exc), code=code) from None


def decode_record(envelope: Envelope) -> Any:
    """The typed record of an envelope, with the tensor layout its kind requires checked."""
    cls = MESSAGES[envelope.kind]
    try:
        record = build(cls, envelope.header, cls.__name__)
    except SchemaError as exc:
        raise ProtocolError(str(exc)) from None
    if cls is RolloutGroup:
        check_group_layout(record, envelope.specs)
    elif cls is AdapterUpdate:
        check_adapter_layout(envelope.specs)
    elif cls is Batch:
        check_batch_layout(record, envelope.specs)
    elif envelope.specs:
        raise ProtocolError(f"{cls.__name__} carries no tensors, got {len(envelope.specs)}")
    return record


def decode(frames: Sequence[Any], max_bytes: int = 1 << 31) -> tuple[Any, Envelope]:
    """(record, envelope) of a received multipart message; raises ProtocolError on any bad input."""
    envelope = decode_envelope(frames, max_bytes)
    return decode_record(envelope), envelope


# -- layout and value checks ---------------------------------------------------------------------------------


def check_group_layout(group: RolloutGroup, specs: Sequence[TensorSpec]) -> None:
    """Per-sample lists agree in length; the five tensors exist with the right dtypes and 1-D sizes."""
    n = len(group.rewards)
    if n == 0:
        raise ProtocolError(f"RolloutGroup {group.group_id}: a group needs at least one sample")
    for name in ("prompt_lens", "completion_lens", "finish_reasons"):
        if len(getattr(group, name)) != n:
            raise ProtocolError(f"RolloutGroup {group.group_id}: {name} has {len(getattr(group, name))} entries, "
                                f"rewards has {n}")
    if any(x < 0 for x in group.prompt_lens) or any(x < 0 for x in group.completion_lens):
        raise ProtocolError(f"RolloutGroup {group.group_id}: sequence lengths must be >= 0")
    if group.min_version > group.max_version:
        raise ProtocolError(f"RolloutGroup {group.group_id}: min_version {group.min_version} > "
                            f"max_version {group.max_version}")
    for name, mean in (group.reward_means or {}).items():
        if len(name) > MAX_ID_LEN or isinstance(mean, bool) or not isinstance(mean, int | float) \
                or not math.isfinite(mean):
            raise ProtocolError(f"RolloutGroup {group.group_id}: reward_means[{name[:MAX_ID_LEN]!r}] must be a "
                                f"finite number under a name of at most {MAX_ID_LEN} characters, got {mean!r:.40}")
    by_name = {s.name: s for s in specs}
    if len(by_name) != len(specs) or set(by_name) != set(GROUP_TENSORS):
        raise ProtocolError(f"RolloutGroup {group.group_id}: tensors must be exactly {sorted(GROUP_TENSORS)}, "
                            f"got {sorted(s.name for s in specs)}")
    for name, (dtype, lens_field) in GROUP_TENSORS.items():
        spec = by_name[name]
        expected = sum(getattr(group, lens_field))
        if spec.dtype != dtype or spec.shape != (expected,):
            raise ProtocolError(f"RolloutGroup {group.group_id}: {name} must be {dtype}[{expected}], "
                                f"got {spec.dtype}{list(spec.shape)}")


def check_adapter_layout(specs: Sequence[TensorSpec]) -> None:
    if not specs:
        raise ProtocolError("AdapterUpdate carries no tensors")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ProtocolError("AdapterUpdate: tensor names must be unique")
    for s in specs:
        if s.dtype not in ("float32", "float16", "bfloat16"):
            raise ProtocolError(f"AdapterUpdate: {s.name} must be a floating dtype, got {s.dtype}")


def check_batch_layout(batch: Batch, specs: Sequence[TensorSpec]) -> None:
    expected_first = 0
    for i, entry in enumerate(batch.groups):
        if entry.first_tensor != expected_first:
            raise ProtocolError(f"Batch: groups[{i}].first_tensor is {entry.first_tensor}, expected {expected_first}")
        check_group_layout(entry.group, specs[expected_first:expected_first + len(GROUP_TENSORS)])
        expected_first += len(GROUP_TENSORS)
    if expected_first != len(specs):
        raise ProtocolError(f"Batch: {len(specs)} tensors for {len(batch.groups)} groups")


_NUMPY_DTYPES = {name: np.dtype(name) for name in GROUP_TENSORS_DTYPES}
_UINT32 = np.dtype(np.uint32)
_MAX, _MIN = np.maximum.reduce, np.minimum.reduce  # the reductions behind ndarray.max/min, one Python call less


def _group_arrays(specs: Sequence[TensorSpec], frames: Sequence[Any]) -> dict[str, np.ndarray]:
    """name -> numpy view of each tensor frame of a group whose layout was checked (1-D, known dtypes)."""
    arrays = {}
    for s in specs:
        dtype = _NUMPY_DTYPES.get(s.dtype)
        if dtype is None or len(s.shape) != 1:
            arrays[s.name] = framing.as_numpy(s, frames[s.frame])
        else:
            frame = frames[s.frame]
            arrays[s.name] = np.frombuffer(frame.buffer if hasattr(frame, "buffer") else frame, dtype=dtype)
    return arrays


def check_group_values(group: RolloutGroup, specs: Sequence[TensorSpec], frames: Sequence[Any], *,
                       vocab_size: int, latest_version: int) -> None:
    """Tensor contents in range, read through numpy views (no copies): raises ProtocolError('invalid_group').

    - token ids in [0, vocab_size) (when vocab_size > 0)
    - log-probs finite and <= 1e-3 (a log-probability; slack for float rounding) at every position, also where
      loss_mask is 0 (environment tokens carry log-prob 0)
    - loss_mask only 0 or 1; versions within [min_version, max_version] and max_version <= latest_version
    - rewards finite (checked by the record already)

    Seven reductions in all (one pass over each id and mask tensor, two over log-probs and versions).
    """
    arrays = _group_arrays(specs, frames)

    def bad(what: str) -> ProtocolError:
        return ProtocolError(f"RolloutGroup {group.group_id}: {what}", code="invalid_group")

    if vocab_size > 0:
        for name in ("prompt_ids", "completion_ids"):
            ids = arrays[name]
            # one pass for both bounds: as unsigned, negative int32 ids are >= 2**31 > any vocab size
            if ids.size and int(_MAX(ids.view(_UINT32))) >= vocab_size:
                raise bad(f"{name} has ids outside [0, {vocab_size}): min {int(ids.min())}, max {int(ids.max())}")
    mask = arrays["loss_mask"]
    if mask.size and int(_MAX(mask)) > 1:
        raise bad("loss_mask must hold only 0 and 1")
    logprobs = arrays["logprobs"]
    if logprobs.size:
        high, low = float(_MAX(logprobs)), float(_MIN(logprobs))  # NaN propagates into both
        if not (math.isfinite(high) and math.isfinite(low)):
            raise bad("logprobs contain NaN or inf")
        if high > 1e-3:
            raise bad(f"logprobs must be <= 0, got {high}")
    if group.max_version > latest_version:
        raise bad(f"max_version {group.max_version} is newer than the latest published version {latest_version}")
    versions = arrays["versions"]
    if versions.size:
        oldest, newest = int(_MIN(versions)), int(_MAX(versions))
        if oldest < group.min_version or newest > group.max_version:
            raise bad(f"token versions span [{oldest}, {newest}], header says "
                      f"[{group.min_version}, {group.max_version}]")


def group_tensors(group_specs: Sequence[TensorSpec], frames: Sequence[Any]) -> dict[str, Any]:
    """name -> torch tensor aliasing the frames (see framing's lifetime rules)."""
    return {s.name: framing.as_torch(s, frames[s.frame]) for s in group_specs}


def error_reply(exc: ProtocolError, ref_kind: int = 0, ref_id: str = "") -> Error:
    return Error(code=exc.code, message=str(exc)[:4000], ref_kind=ref_kind, ref_id=ref_id[:MAX_ID_LEN])
