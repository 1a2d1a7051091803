"""The wire protocol: message kinds, the protocol version and the typed message records, with their bounds.

Who sends what (all through the broker's one ROUTER socket; clients use DEALER sockets)::

    worker  -> broker   Hello, Heartbeat, LeaseRequest, RolloutGroup, LeaseReturn, AdapterFetch, Bye
    broker  -> worker   Welcome, Heartbeat (pong), LeaseGrant, GroupAck (one group, or several: ref_ids),
                        AdapterNotice, AdapterUpdate, Error
    learner -> broker   Hello, Heartbeat, AdapterUpdate (publish), BatchRequest, BatchAck, Bye
    broker  -> learner  Welcome, Heartbeat (pong), AdapterAck, Batch, BatchSettled, Error
    anyone  -> broker   StatsRequest  ->  Stats

Every record is a ``msgspec.Struct`` (:class:`loraflow.common.wire.Record`) whose annotations carry their bounds;
:mod:`loraflow.common.codec` encodes a record with its tensor frames and decodes frames back into a checked
record. The three replies of kind ACK (:data:`Ack`) are told apart by ``ref_kind``, the kind of what they
acknowledge. Codes, reasons and states are ``enum.StrEnum`` (:mod:`loraflow.common.codes`): typed in the code, the
same strings on the wire as ever (a raw msgpack client sends ``"stop"`` and reads ``"accepted"``).

Everything a peer sends is bounded at decode, so nothing it sends can fail later where it is re-encoded or
shown: ``Heartbeat.counters`` and ``RolloutGroup.metrics`` hold at most 64 finite numbers under names of at most
64 characters; other free-form values (``meta``, ``columns``, ``prompt_messages``, ``adapter_config``) nest at
most :data:`loraflow.common.wire.MAX_DEPTH` levels; every policy version is at most :data:`MAX_VERSION` (tokens carry
versions as int32). A lease id is bound to the worker it was granted to (:mod:`loraflow.broker.prompts`); with
security off a learner's Hello carries the run token (``Hello.token``, :mod:`loraflow.common.run_token`).

Compatibility: new fields are appended with defaults. Within one protocol version a field the receiver does not
know (a newer peer's) is ignored, and the decode says so (``Envelope.unknown_fields``; the broker counts
``unknown_fields{kind}``); a field the sender does not know (an older peer's) takes its default. An
incompatible change bumps ``PROTOCOL_VERSION``; every message carries it in its preamble and a mismatch is
refused with an Error naming both versions.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

from msgspec import UNSET, Meta, UnsetType, field

from loraflow.common.codes import (
    AckStatus,
    ClientState,
    EngineDtype,
    ErrorCode,
    FinishReason,
    GrantReason,
    MismatchReason,
    Role,
)
from loraflow.common.framing import TensorSpec
from loraflow.common.wire import FLOAT_MAX, MAX_KEY_LEN, Finite, Record

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
MAX_RUN_SETTINGS_LEN = 64 << 10  # a submitted run file's TOML text
#: policy versions travel as int32 in the token ``versions`` tensor: no version may exceed this
MAX_VERSION = (1 << 31) - 1


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
    RUN_SUBMIT = 60
    RUN_CANCEL = 61
    RUN_REPLY = 62


KNOWN_KINDS = frozenset(int(k) for k in Kind)


# -- field types (bounds msgspec checks while it decodes) -----------------------------------------------------


def text(max_len: int) -> Any:
    return Annotated[str, Meta(max_length=max_len)]


def bounded_list(item: Any, max_len: int) -> Any:
    return Annotated[list[item], Meta(max_length=max_len)]


Id = text(MAX_ID_LEN)
Version = Annotated[int, Meta(ge=0, le=MAX_VERSION)]
PublishedVersion = Annotated[int, Meta(ge=1, le=MAX_VERSION)]  # v0 is the base model: never published
Count = Annotated[int, Meta(ge=0)]
NonNegative = Annotated[float, Meta(ge=0, le=FLOAT_MAX)]  # finite
Positive = Annotated[float, Meta(gt=0, le=FLOAT_MAX)]
#: a map of finite numbers under names of at most MAX_KEY_LEN characters (counters, metrics)
Numbers = Annotated[dict[Annotated[str, Meta(max_length=MAX_KEY_LEN)], int | Finite], Meta(max_length=MAX_COUNTERS)]
FreeMap = Annotated[dict[str, Any], Meta(max_length=256)]  # nesting bounded after the decode (loraflow.common.wire)


class Message(Record, kw_only=True):
    """A record sent as a whole message. ``tensors`` is the header's tensor specs: set by
    :func:`loraflow.common.codec.encode`, moved to ``Envelope.specs`` by :func:`loraflow.common.codec.decode` (a
    record in hand never holds them; unset ones are not encoded)."""

    KIND: ClassVar[Kind]
    tensors: list[TensorSpec] | UnsetType = UNSET


# -- records -------------------------------------------------------------------------------------------------


class Hello(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.HELLO
    role: Role  # what the client is
    client_id: Id  # stable name of the client (worker id, 'learner')
    run: Id = ""  # the pool run it joins (run.pool_run); "" = the broker's own run (loraflow.broker.pool)
    backend: text(64) = ""  # generation backend of a worker
    capacity: Annotated[int, Meta(ge=1, le=1024)] = 1  # leases a worker can hold at once
    adapter_version: Version = 0  # policy version the client holds
    host: text(256) = ""
    pid: Count = 0
    #: random per process start: a new session of a known id means the old process died and its leases are reclaimed
    session: Id = ""
    #: the client reads GroupAck.ref_ids, so the broker may acknowledge several rollout groups in one GroupAck
    batched_acks: bool = False
    #: the run token a learner presents when security is off (common/run_token.py); other roles send none
    token: text(128) = ""
    #: the client says hello again when it hears nothing from the broker for this long (its heartbeat timeout);
    #: the broker answers its heartbeats often enough for that, not necessarily every one (0: unknown, each beat
    #: is answered)
    silence_timeout_s: Annotated[float, Meta(ge=0, le=86_400)] = 0.0
    #: the interval the client beats at on its own; a client that says it follows the interval the broker asks
    #: for (``Welcome.heartbeat_interval_s``, ``Heartbeat.interval_s`` in pongs) whenever that is longer, and
    #: stretches its silence timeout by the same factor (0: an older client, which keeps its own interval)
    heartbeat_interval_s: Annotated[float, Meta(ge=0, le=3_600)] = 0.0


class Welcome(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.WELCOME
    broker_id: Id  # random per broker start: a new id means the broker restarted
    latest_version: Version
    group_size: Annotated[int, Meta(ge=1, le=MAX_GROUP_SIZE)]
    groups_per_step: Annotated[int, Meta(ge=1, le=MAX_BATCH_GROUPS)]
    max_staleness: Count
    heartbeat_interval_s: Positive  # the interval the broker asks for now (broker.max_heartbeats_per_second)
    heartbeat_timeout_s: Positive  # after this long silent (interval x misses) a client is declared dead
    lease_timeout_s: Positive
    max_message_bytes: Annotated[int, Meta(ge=1)]
    vocab_size: Count = 0  # token ids must be below this; 0 = not checked


class Heartbeat(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.HEARTBEAT
    adapter_version: Version = 0
    latest_version: Version = 0  # set by the broker in its pong
    state: ClientState = ClientState.IDLE
    num_leases: Count = 0
    #: cumulative client counters for stats: numbers under names of at most 64 characters
    counters: Numbers = field(default_factory=dict)
    #: leases the worker is still working on: the broker renews those it holds for broker.lease_timeout_s from
    #: now (a long generation is never generated twice)
    lease_ids: bounded_list(Id, MAX_RENEWED_LEASES) = field(default_factory=list)
    #: set by the broker in its pong: the interval it asks its clients to beat at now, longer than
    #: broker.heartbeat_interval_s when the fleet would send more than broker.max_heartbeats_per_second (0: not set)
    interval_s: Annotated[float, Meta(ge=0, le=3_600)] = 0.0


class Error(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.ERROR
    code: ErrorCode
    message: text(4000)
    ref_kind: Count = 0  # kind of the message this answers
    ref_id: Id = ""
    #: the adapter version an AdapterUpdate or AdapterFetch this answers named (0: none); ref_id carries it as
    #: text as well, for readers older than this field
    ref_version: Version = 0


class Bye(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.BYE
    reason: text(256) = ""


class LeaseRequest(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.LEASE_REQUEST
    max_leases: Annotated[int, Meta(ge=1, le=1024)] = 1
    adapter_version: Version = 0
    #: long-poll: answer within this time even if nothing is granted
    wait_ms: Annotated[int, Meta(ge=0, le=600_000)] = 1000


class PromptLease(Record, kw_only=True):
    lease_id: Id
    group_id: Id  # stable per (epoch, prompt): the dedup key
    prompt_index: Count
    epoch: Count
    task: text(128)
    prompt: text(MAX_TEXT_LEN)
    answer: text(MAX_TEXT_LEN) = ""
    meta: FreeMap = field(default_factory=dict)
    group_size: Annotated[int, Meta(ge=1, le=MAX_GROUP_SIZE)]
    deadline_s: Positive  # time from grant until the lease is reclaimed
    #: a conversational prompt ([{role, content}], TRL's format); then ``prompt`` is empty. None: ``prompt`` is it
    prompt_messages: bounded_list(dict[str, Any], MAX_MESSAGES) | None = None
    #: the dataset row's other columns: the reward functions' keyword arguments (see common/dataset.py)
    columns: FreeMap | None = None

    @property
    def prompt_value(self) -> str | list[dict[str, Any]]:
        """The prompt as the dataset has it: the text, or the list of messages."""
        return self.prompt_messages if self.prompt_messages is not None else self.prompt


class LeaseGrant(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.LEASE_GRANT
    leases: bounded_list(PromptLease, 1024) = field(default_factory=list)
    reason: GrantReason = GrantReason.NONE  # why nothing (or less) was granted
    latest_version: Version = 0


class LeaseReturn(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.LEASE_RETURN
    lease_ids: bounded_list(Id, 1024)
    reason: text(256) = ""


class ServedAdapter(Record, kw_only=True):
    """What the engine served one policy version with, as the engine reports it (the evidence of
    :mod:`loraflow.common.integrity`): read back from the engine after the load, never copied from what the worker meant
    to load. v0, the base model, is ``adapter=""``, ``lora_id=0``, ``sha256=""``."""

    version: Version
    adapter: text(128) = ""  # the engine's name for the adapter (vLLM lora_name, hf peft slot)
    #: the engine's int id of the loaded weights (vLLM lora_int_id, hf load number): one id never names two
    #: versions in one worker process
    lora_id: Version = 0
    #: sha256 of the tensor bytes the engine loaded, computed as AdapterUpdate.sha256
    #: (loraflow.common.framing.frames_sha256 in the published tensor order)
    sha256: text(64) = ""
    dtype: EngineDtype = EngineDtype.FLOAT32  # the engine's compute dtype (sets the tolerance)


class RolloutGroup(Message, kw_only=True):
    """One prompt x group_size samples. Per-sample token arrays are concatenated in sample order.

    ``completion_*`` covers everything after the prompt: generated tokens (loss_mask 1) and, in multi-turn
    tasks, environment tokens (loss_mask 0, logprob 0). ``logprobs`` are the behaviour policy's log-probs of the
    sampled tokens (see :mod:`loraflow.common.logprobs`); ``versions`` the policy version that produced each token.
    """

    KIND: ClassVar[Kind] = Kind.ROLLOUT_GROUP
    group_id: Id
    lease_id: Id
    worker_id: Id
    task: text(128) = ""
    prompt_lens: bounded_list(Count, MAX_GROUP_SIZE)
    completion_lens: bounded_list(Count, MAX_GROUP_SIZE)
    rewards: bounded_list(Finite, MAX_GROUP_SIZE)
    finish_reasons: bounded_list(FinishReason, MAX_GROUP_SIZE)
    min_version: Version  # oldest policy version of any generated token
    max_version: Version
    generate_s: NonNegative = 0.0
    reward_s: NonNegative = 0.0
    created_unix: NonNegative = 0.0
    num_reward_failures: Count = 0
    metrics: Numbers = field(default_factory=dict)  # finite numbers under names of at most 64 characters
    #: reward function name -> its mean over the samples it applied to (a function that applied to none is absent)
    reward_means: Annotated[dict[Id, Finite], Meta(max_length=MAX_REWARD_FUNCTIONS)] | None = None
    #: one entry per distinct version in ``versions``: the adapter the engine served it with (checked by the
    #: learner, common/integrity.py)
    served: bounded_list(ServedAdapter, MAX_SERVED) = field(default_factory=list)
    #: set by the broker in a Batch: the Hello session of the process that submitted the group (whatever a worker
    #: puts here is replaced, and so is worker_id, by the id that process said Hello with)
    worker_session: Id = ""

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


class GroupAck(Message, kw_only=True, tag_field="ref_kind", tag=int(Kind.ROLLOUT_GROUP)):
    """Rollout groups the broker holds (accepted now, or earlier: duplicate); the worker drops its copies."""

    KIND: ClassVar[Kind] = Kind.ACK
    ref_kind: ClassVar[int] = Kind.ROLLOUT_GROUP  # on the wire: the tag telling the replies of kind ACK apart
    ref_id: Id  # the group id
    status: AckStatus = AckStatus.ACCEPTED
    #: more group ids this GroupAck acknowledges, with the same status (sent only to clients that said
    #: Hello(batched_acks=True)); None: ref_id alone
    ref_ids: bounded_list(Id, MAX_BATCH_GROUPS) | None = None

    @property
    def ids(self) -> list[str]:
        """Every group id this GroupAck acknowledges: ref_id, then ref_ids."""
        return [self.ref_id, *self.ref_ids] if self.ref_ids else [self.ref_id]


class AdapterAck(Message, kw_only=True, tag_field="ref_kind", tag=int(Kind.ADAPTER_UPDATE)):
    """The broker took adapter ``version`` (it relays it to the workers)."""

    KIND: ClassVar[Kind] = Kind.ACK
    ref_kind: ClassVar[int] = Kind.ADAPTER_UPDATE
    version: PublishedVersion
    ref_id: Id = ""  # the version as text, for clients that read an Ack's ref_id (set from version)

    def __post_init__(self) -> None:
        if not self.ref_id:
            self.ref_id = str(self.version)


class BatchSettled(Message, kw_only=True, tag_field="ref_kind", tag=int(Kind.BATCH_ACK)):
    """The broker applied (and persisted) a BatchAck; the learner stops re-sending it."""

    KIND: ClassVar[Kind] = Kind.ACK
    ref_kind: ClassVar[int] = Kind.BATCH_ACK
    ref_id: Id  # the batch id

    @property
    def batch_id(self) -> str:
        return self.ref_id


#: every reply of kind ACK (``isinstance(record, Ack)``); ``ref_kind`` says which
Ack = GroupAck | AdapterAck | BatchSettled


class AdapterUpdate(Message, kw_only=True):
    """A LoRA adapter version; tensors carry PEFT state-dict names. sha256 covers the tensor bytes in order."""

    KIND: ClassVar[Kind] = Kind.ADAPTER_UPDATE
    version: PublishedVersion
    step: Count = 0
    sha256: text(64)
    adapter_config: FreeMap  # PEFT adapter_config.json contents
    base_model: text(4096) = ""
    created_unix: NonNegative = 0.0


class AdapterNotice(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.ADAPTER_NOTICE
    version: PublishedVersion
    num_bytes: Count
    sha256: text(64)


class AdapterFetch(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.ADAPTER_FETCH
    version: Version = 0  # 0 = the newest


class BatchRequest(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.BATCH_REQUEST
    num_groups: Annotated[int, Meta(ge=1, le=MAX_BATCH_GROUPS)]
    wait_ms: Annotated[int, Meta(ge=0, le=600_000)] = 1000
    learner_version: Version = 0


class BatchEntry(Record, kw_only=True):
    group: RolloutGroup
    first_tensor: Count  # index of the group's first tensor spec in the batch


class Batch(Message, kw_only=True):
    """Whole groups for one learner step; empty when the long-poll timed out."""

    KIND: ClassVar[Kind] = Kind.BATCH
    batch_id: Id = ""
    groups: bounded_list(BatchEntry, MAX_BATCH_GROUPS) = field(default_factory=list)
    latest_version: Version = 0


class PolicyMismatch(Record, kw_only=True):
    """One group the learner refused to train because its tokens are not what the version it claims generates."""

    group_id: Id
    worker_id: Id = ""  # as the group says; the broker uses its own record
    reason: MismatchReason
    version: Version = 0  # the claimed version that failed
    num_checked: Count = 0  # tokens compared
    num_off: Count = 0  # tokens off by more than the tolerance
    max_abs_diff: NonNegative = 0.0  # largest |behaviour - recomputed| log-prob (nats)
    mean_abs_diff: NonNegative = 0.0  # mean |behaviour - recomputed| log-prob (nats)
    detail: text(512) = ""


class BatchAck(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.BATCH_ACK
    batch_id: Id
    step: Count
    trained_version: Version  # policy version of the parameters the step updated
    #: exactly the groups done with (trained, or already trained): served groups not listed are re-queued; lets a
    #: restarted broker recognise a batch it never served
    group_ids: bounded_list(Id, MAX_BATCH_GROUPS) = field(default_factory=list)
    checkpoint_version: Version = 0  # newest version covered by a durable learner checkpoint
    #: groups of the batch that failed the policy check: not trained, not listed in group_ids (so re-queued); the
    #: broker counts them against the worker that sent them
    mismatches: bounded_list(PolicyMismatch, MAX_BATCH_GROUPS) = field(default_factory=list)


class StatsRequest(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.STATS_REQUEST
    run: Id = ""  # whose picture: a pool run's id, "" = the broker's own run


class Stats(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.STATS
    snapshot: dict[str, Any] = field(default_factory=dict)


class RunSubmit(Message, kw_only=True):
    """A tenant's run for a pool broker (``loraflow submit --endpoint``); with CURVE the observer key that sends
    it owns the run: only that key (or the pool's own observer key) may watch or cancel it."""

    KIND: ClassVar[Kind] = Kind.RUN_SUBMIT
    run: text(48) = ""  # the id asked for; "" = the run file's run.name, else run-N
    settings: text(MAX_RUN_SETTINGS_LEN)  # the run file's TOML (the sections a run may set)


class RunCancel(Message, kw_only=True):
    KIND: ClassVar[Kind] = Kind.RUN_CANCEL
    run: text(48)
    reason: text(1000) = "loraflow cancel"


class RunReply(Message, kw_only=True):
    """The answer to RunSubmit or RunCancel (a refusal is an Error)."""

    KIND: ClassVar[Kind] = Kind.RUN_REPLY
    run: text(48)
    state: text(32)  # submitted | cancelling


MESSAGES: dict[int, Any] = {
    int(cls.KIND): cls
    for cls in (Hello, Welcome, Heartbeat, Error, Bye, LeaseRequest, LeaseGrant, LeaseReturn, RolloutGroup,
                AdapterUpdate, AdapterNotice, AdapterFetch, BatchRequest, Batch, BatchAck, StatsRequest, Stats,
                RunSubmit, RunCancel, RunReply)
}
MESSAGES[Kind.ACK] = Ack
assert set(MESSAGES) == KNOWN_KINDS
