"""Who may send what, and the contract every handler keeps: validate everything first, then apply.

Per message, in order (:meth:`loraflow.broker.core.BrokerCore.handle`): framing checks (size, protocol version, header)
-> a fenced learner's identity is refused -> who may send it (:data:`SENDERS`: unknown identities may only say
Hello or ask for Stats; with CURVE the role claimed must be the role the key is authorised for,
:func:`refusal`) -> the record's validating decode (bounds on every field, free-form ones included) -> the
handler. Every refusal is an Error reply plus ``rejected{reason}``.

A handler has two halves. Its *validation* reads and decides: whatever a peer sends, a refusal is the answer,
and a bug there costs one message (the server answers ``internal`` and carries on: nothing was changed). Its
*apply* half starts where it sets ``BrokerCore._applying`` and changes state (ledger transitions, versions, the
registry); no refusal of bad input happens inside it. An exception in an apply half is a bug that may have
left the state half-changed, so :meth:`BrokerCore.handle` raises :class:`HalfApplied` and the server lets it
end the process: the state file holds only what a complete loop pass wrote, the supervisor restarts the
broker, and the clients' at-least-once delivery covers the rest.
"""

from __future__ import annotations

from typing import Any

from loraflow.common import framing
from loraflow.common.protocol import Kind

KIND_NAMES = {int(k): k.name.lower() for k in Kind}
ANYONE = frozenset({"worker", "learner", "observer"})
#: who may send each kind; None = also unregistered identities; kinds missing here only the broker sends
SENDERS: dict[int, frozenset[str] | None] = {
    Kind.HELLO: None,
    Kind.STATS_REQUEST: None,
    Kind.HEARTBEAT: ANYONE,
    Kind.BYE: ANYONE,
    Kind.LEASE_REQUEST: frozenset({"worker"}),
    Kind.LEASE_RETURN: frozenset({"worker"}),
    Kind.ROLLOUT_GROUP: frozenset({"worker"}),
    Kind.ADAPTER_FETCH: frozenset({"worker", "learner"}),
    Kind.ADAPTER_UPDATE: frozenset({"learner"}),
    Kind.BATCH_REQUEST: frozenset({"learner"}),
    Kind.BATCH_ACK: frozenset({"learner"}),
}


class HalfApplied(RuntimeError):
    """A handler raised after it began changing state: a bug; the broker process must end (see above)."""


def claimed_role(envelope: framing.Envelope) -> Any:
    """The role a Hello claims (from its record, or from its plain header when the record is invalid)."""
    if envelope.kind != Kind.HELLO:
        return None
    return envelope.record.role if envelope.record is not None else envelope.header.get("role")


def refusal(kind: int, claimed: Any, role: str | None, authenticated_role: str | None
            ) -> tuple[str, str] | None:
    """(code, message) when a sender registered as ``role`` (None: not registered) may not send ``kind``;
    ``claimed``: the role a Hello claims (:func:`claimed_role`)."""
    if kind not in SENDERS:
        return "forbidden", f"{KIND_NAMES[kind]} messages are sent by the broker, not to it"
    if authenticated_role is not None:
        claimed = claimed if kind == Kind.HELLO else role
        if claimed is not None and claimed != authenticated_role:
            return "forbidden", (f"this key is authorised as a {authenticated_role}, not as a {claimed} "
                                 "(see `loraflow keys`)")
    allowed = SENDERS[kind]
    if allowed is None:
        return None
    if role is None:
        return "not_registered", f"say Hello before sending {KIND_NAMES[kind]}"
    if role not in allowed:
        return "forbidden", f"a {role} may not send {KIND_NAMES[kind]} (only {', '.join(sorted(allowed))})"
    return None


def peek_kind(frames: list[Any]) -> int:
    """The kind a message's preamble names, or 0 (for the Error reply to one that failed its decode)."""
    try:
        magic, _, kind = framing.PREAMBLE.unpack(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0])
    except Exception:  # anything that is not a preamble
        return 0
    return kind if magic == framing.MAGIC and 0 < kind < 1 << 16 else 0


def num_bytes(frames: list[Any]) -> int:
    return sum(len(f) for f in frames)
