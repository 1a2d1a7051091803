"""protocol: every record round-trips; bad fields, layouts and values are refused with the field named."""

from __future__ import annotations

import contextlib
import math

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraflow.common import codec, framing, group_checks, protocol
from loraflow.common.codes import ProtocolError
from loraflow.common.protocol import PROTOCOL_VERSION, Batch, BatchEntry, Kind, RolloutGroup


def make_group(n: int = 2, prompt_len: int = 3, completion_lens: tuple[int, ...] = (2, 1), **overrides):
    group = RolloutGroup(group_id="0:7", lease_id="L1", worker_id="w1", prompt_lens=[prompt_len] * n,
                         completion_lens=list(completion_lens), rewards=[1.0] * n, finish_reasons=["stop"] * n,
                         min_version=0, max_version=1)
    for key, value in overrides.items():
        setattr(group, key, value)
    total = sum(completion_lens)
    tensors = {
        "prompt_ids": np.arange(n * prompt_len, dtype=np.int32) % 10,
        "completion_ids": np.arange(total, dtype=np.int32) % 10,
        "logprobs": -np.linspace(0.1, 1.0, total).astype(np.float32),
        "versions": np.array([0] + [1] * (total - 1), dtype=np.int32),
        "loss_mask": np.ones(total, dtype=np.uint8),
    }
    return group, tensors


SAMPLES = [
    protocol.Hello(role="worker", client_id="w1", backend="hf", capacity=2, adapter_version=3, session="abc"),
    protocol.Welcome(broker_id="b", latest_version=4, group_size=8, groups_per_step=16, max_staleness=1,
                     heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0, lease_timeout_s=60.0,
                     max_message_bytes=1 << 20, vocab_size=259),
    protocol.Heartbeat(adapter_version=2, state="generating", num_leases=1, counters={"tokens": 10}),
    protocol.Error(code="malformed", message="bad", ref_kind=20, ref_id="x"),
    protocol.Bye(reason="sigterm"),
    protocol.LeaseRequest(max_leases=2, adapter_version=1, wait_ms=500),
    protocol.LeaseGrant(leases=[protocol.PromptLease(lease_id="L", group_id="0:1", prompt_index=1, epoch=0, task="arith",
                                                     prompt="1+2=", answer="3", group_size=8, deadline_s=30.0)],
                        latest_version=2),
    protocol.LeaseReturn(lease_ids=["L"], reason="sigterm"),
    protocol.GroupAck(ref_id="0:1", status="duplicate"),
    protocol.GroupAck(ref_id="0:1", ref_ids=["0:2", "0:3"]),
    protocol.AdapterAck(version=3),
    protocol.BatchSettled(ref_id="b1"),
    protocol.AdapterNotice(version=3, num_bytes=100, sha256="a" * 64),
    protocol.AdapterFetch(version=0),
    protocol.BatchRequest(num_groups=4, wait_ms=100, learner_version=2),
    protocol.BatchAck(batch_id="b1", step=3, trained_version=2, group_ids=["0:1"], checkpoint_version=1),
    protocol.StatsRequest(),
    protocol.Stats(snapshot={"workers": []}),
    protocol.RunSubmit(run="a", settings="[run]\nseed = 1\n"),
    protocol.RunCancel(run="a", reason="by the tenant"),
    protocol.RunReply(run="a", state="submitted"),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_tensorless_records_round_trip(message) -> None:
    record, envelope = codec.decode(codec.encode(message))
    assert record == message and envelope.kind == int(message.KIND)


def test_every_kind_has_a_record_and_a_sample() -> None:
    covered = {int(m.KIND) for m in SAMPLES} | {Kind.ROLLOUT_GROUP, Kind.ADAPTER_UPDATE, Kind.BATCH}
    assert covered == set(protocol.MESSAGES)


def test_rollout_group_round_trip_and_value_checks_pass() -> None:
    group, tensors = make_group()
    record, env = codec.decode(codec.encode(group, list(tensors.items())))
    assert record == group
    group_checks.check_group_values(record, env.specs, env.frames, vocab_size=10, latest_version=1)
    got = group_checks.group_tensors(env.specs, env.frames)
    np.testing.assert_array_equal(got["logprobs"].numpy(), tensors["logprobs"])


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda g, t: setattr(g, "rewards", [1.0]), "prompt_lens has 2 entries, rewards has 1"),
        (lambda g, t: setattr(g, "min_version", 5), "min_version 5 > max_version 1"),
        (lambda g, t: t.pop("loss_mask"), "tensors must be exactly"),
        (lambda g, t: t.__setitem__("logprobs", t["logprobs"].astype(np.float64)), "logprobs must be float32"),
        (lambda g, t: t.__setitem__("versions", t["versions"][:2]), r"versions must be int32\[3\]"),
        (lambda g, t: setattr(g, "finish_reasons", ["stop", "exploded"]), "must be one of"),
        (lambda g, t: (setattr(g, "rewards", []), setattr(g, "prompt_lens", []), setattr(g, "completion_lens", []),
                       setattr(g, "finish_reasons", [])), "at least one sample"),
    ],
)
def test_rollout_group_layout_errors(change, needle: str) -> None:
    group, tensors = make_group()
    change(group, tensors)
    with pytest.raises(ProtocolError, match=needle) as info:
        codec.decode(codec.encode(group, list(tensors.items())))
    assert info.value.code == "malformed"


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda t: t["logprobs"].__setitem__(0, np.nan), "NaN or inf"),
        (lambda t: t["logprobs"].__setitem__(1, np.inf), "NaN or inf"),
        (lambda t: t["logprobs"].__setitem__(1, 0.5), "must be <= 0"),
        (lambda t: t["completion_ids"].__setitem__(0, 10), r"outside \[0, 10\)"),
        (lambda t: t["prompt_ids"].__setitem__(0, -1), r"outside \[0, 10\)"),
        (lambda t: t["loss_mask"].__setitem__(0, 2), "only 0 and 1"),
        (lambda t: t["versions"].__setitem__(0, 3), "token versions span"),
    ],
)
def test_rollout_group_value_errors(change, needle: str) -> None:
    group, tensors = make_group()
    change(tensors)
    record, env = codec.decode(codec.encode(group, list(tensors.items())))
    with pytest.raises(ProtocolError, match=needle) as info:
        group_checks.check_group_values(record, env.specs, env.frames, vocab_size=10, latest_version=1)
    assert info.value.code == "invalid_group"


def test_group_from_the_future_is_refused() -> None:
    group, tensors = make_group()
    record, env = codec.decode(codec.encode(group, list(tensors.items())))
    with pytest.raises(ProtocolError, match="newer than the latest published version 0"):
        group_checks.check_group_values(record, env.specs, env.frames, vocab_size=0, latest_version=0)


def test_nan_reward_is_refused_at_decode() -> None:
    group, tensors = make_group()
    group.rewards = [math.nan, 1.0]
    with pytest.raises(ProtocolError, match=r"rewards\[0\]: must be a finite number"):
        codec.decode(codec.encode(group, list(tensors.items())))


def test_batch_forwards_group_frames_and_checks_layout() -> None:
    g1, t1 = make_group()
    g2, t2 = make_group(n=1, completion_lens=(4,), group_id="0:8")
    frames1 = codec.encode(g1, list(t1.items()))
    frames2 = codec.encode(g2, list(t2.items()))
    env1, env2 = codec.decode_envelope(frames1, 1 << 20), codec.decode_envelope(frames2, 1 << 20)
    batch = Batch(batch_id="b1", groups=[BatchEntry(group=g1, first_tensor=0), BatchEntry(group=g2, first_tensor=5)])
    specs = list(env1.specs) + [framing.TensorSpec(s.name, s.dtype, s.shape, s.frame + 5) for s in env2.specs]
    record, env = codec.decode(codec.encode_with_frames(batch, specs, env1.frames + env2.frames))
    assert [e.group.group_id for e in record.groups] == ["0:7", "0:8"]
    second = env.specs[5:10]
    got = group_checks.group_tensors(second, env.frames)
    np.testing.assert_array_equal(got["completion_ids"].numpy(), t2["completion_ids"])
    bad = Batch(batch_id="b1", groups=[BatchEntry(group=g1, first_tensor=0), BatchEntry(group=g2, first_tensor=4)])
    with pytest.raises(ProtocolError, match=r"groups\[1\].first_tensor is 4, expected 5"):
        codec.decode(codec.encode_with_frames(bad, specs, env1.frames + env2.frames))


def test_adapter_update_layout() -> None:
    update = protocol.AdapterUpdate(version=1, sha256="0" * 64, adapter_config={"r": 8})
    record, env = codec.decode(codec.encode(update, [("a", np.zeros((2, 2), np.float32))]))
    assert record.version == 1 and env.specs[0].shape == (2, 2)
    with pytest.raises(ProtocolError, match="carries no tensors"):
        codec.decode(codec.encode(update))
    with pytest.raises(ProtocolError, match="must be a floating dtype"):
        codec.decode(codec.encode(update, [("a", np.zeros(2, np.int32))]))


def test_tensors_on_a_tensorless_kind_are_refused() -> None:
    with pytest.raises(ProtocolError, match="Bye carries no tensors"):
        codec.decode(codec.encode(protocol.Bye(), [("x", np.zeros(1, np.float32))]))


def test_protocol_version_mismatch_names_both_versions() -> None:
    frames = framing.pack(int(Kind.HELLO), PROTOCOL_VERSION + 1, {"role": "worker", "client_id": "w"})
    with pytest.raises(ProtocolError, match=f"peer speaks {PROTOCOL_VERSION + 1}, this process speaks "
                                            f"{PROTOCOL_VERSION}") as info:
        codec.decode(frames)
    assert info.value.code == "protocol_version"


def test_oversize_message_gets_the_oversize_code() -> None:
    frames = codec.encode(protocol.AdapterUpdate(version=1, sha256="", adapter_config={}),
                             [("a", np.zeros(10_000, np.float32))])
    with pytest.raises(ProtocolError) as info:
        codec.decode(frames, max_bytes=1000)
    assert info.value.code == "oversize"


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        ({"client_id": "w"}, "Hello.role: required field is missing"),
        ({"role": "worker", "client_id": 5}, "Hello.client_id: expected a string"),
        ({"role": "worker", "client_id": "w", "capacity": 0}, "Hello.capacity: must be >= 1"),
        ({"role": "worker", "client_id": "w", "capacity": True}, "expected an integer"),
        ({"role": "worker", "client_id": "w" * 200}, "at most 128"),
        ({"role": "captain", "client_id": "w"}, "Hello.role: must be one of"),
    ],
)
def test_hello_field_errors_name_the_field(header: dict, needle: str) -> None:
    frames = framing.pack(int(Kind.HELLO), PROTOCOL_VERSION, header)
    with pytest.raises(ProtocolError, match=needle):
        codec.decode(frames)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=400, deadline=None)
@given(kind=st.sampled_from(sorted(protocol.MESSAGES)), header=st.dictionaries(st.text(max_size=16), json_values, max_size=8),
       extra=st.lists(st.binary(max_size=32), max_size=3))
def test_random_headers_raise_only_protocol_errors(kind: int, header: dict, extra: list[bytes]) -> None:
    frames = [framing.PREAMBLE.pack(framing.MAGIC, PROTOCOL_VERSION, kind), msgpack.packb(header), *extra]
    with contextlib.suppress(ProtocolError):
        codec.decode(frames)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_group_fields_raise_only_protocol_errors(data: st.DataObject) -> None:
    group, tensors = make_group()
    frames = codec.encode(group, list(tensors.items()))
    header = msgpack.unpackb(frames[1])
    key = data.draw(st.sampled_from(sorted(header)))
    header[key] = data.draw(json_values)
    frames[1] = msgpack.packb(header)
    try:
        record, env = codec.decode(frames)
        group_checks.check_group_values(record, env.specs, env.frames, vocab_size=10, latest_version=1)
    except ProtocolError:
        pass


def _nested(levels: int, leaf: object = 1, as_list: bool = False) -> object:
    value = leaf
    for _ in range(levels):
        value = [value] if as_list else {"a": value}
    return value


def _lease_fields(**overrides: object) -> dict:
    return {"lease_id": "L", "group_id": "0:1", "prompt_index": 1, "epoch": 0, "task": "t", "prompt": "p",
            "group_size": 1, "deadline_s": 1.0, **overrides}


@pytest.mark.parametrize("kind, header, needle", [
    # nested near msgpack's own limit: refused without recursion, naming the field
    (Kind.HEARTBEAT, {"counters": {"a": _nested(1020)}}, "Heartbeat.counters['a']: expected int or float"),
    (Kind.HEARTBEAT, {"counters": {"a": float("inf")}}, "Heartbeat.counters['a']: must be a finite number"),
    (Kind.HEARTBEAT, {"counters": {"a": True}}, "Heartbeat.counters['a']: expected int or float"),
    (Kind.HEARTBEAT, {"counters": {"k" * 65: 1}}, "longer than 64 characters"),
    (Kind.HEARTBEAT, {"counters": {f"k{i}": 1 for i in range(65)}}, "Heartbeat.counters: at most 64"),
    (Kind.LEASE_GRANT, {"leases": [_lease_fields(meta=_nested(1020))]}, "LeaseGrant.leases[0].meta: nested more"),
    (Kind.LEASE_GRANT, {"leases": [_lease_fields(columns={"c": _nested(40, as_list=True)})]},
     "LeaseGrant.leases[0].columns: nested more than 32"),
    (Kind.LEASE_GRANT, {"leases": [_lease_fields(prompt_messages=[{"role": "user", "content": _nested(40)}])]},
     "LeaseGrant.leases[0].prompt_messages[0]: nested more than 32"),
    (Kind.ADAPTER_UPDATE, {"version": 1 << 31, "sha256": "", "adapter_config": {}}, "must be <= 2147483647"),
    (Kind.HELLO, {"role": "worker", "client_id": _nested(900, as_list=True)}, "Hello.client_id: expected a string, "
     "got array"),
    (Kind.HELLO, {"role": _nested(900), "client_id": "x"}, "Hello.role: expected a string, got object"),
    # a free-form value nested past Python's recursion limit (msgspec recurses), in a field or an unknown one
    (Kind.LEASE_GRANT, {"leases": [_lease_fields(columns={"c": _nested(1020, as_list=True)})]},
     "LeaseGrant.leases[0].columns: nested more than 32"),
    (Kind.HELLO, {"role": "worker", "client_id": "x", "newer": _nested(1020)}, "Hello.newer: nested more than 32"),
    (Kind.LEASE_GRANT, {"leases": [_lease_fields(meta={1: 2})]}, "LeaseGrant.leases[0].meta: map keys must be"),
])
def test_free_form_and_version_fields_are_bounded_at_decode(kind: int, header: dict, needle: str) -> None:
    frames = [framing.PREAMBLE.pack(framing.MAGIC, PROTOCOL_VERSION, kind), msgpack.packb(header)]
    with pytest.raises(ProtocolError) as caught:
        codec.decode(frames)
    assert caught.value.code == "malformed" and needle in str(caught.value), str(caught.value)


def test_bounded_free_form_values_still_pass() -> None:
    lease = _lease_fields(meta=_nested(31), columns={"rows": [[{"x": 1}]]},
                          prompt_messages=[{"role": "user", "content": "hi"}])
    frames = [framing.PREAMBLE.pack(framing.MAGIC, PROTOCOL_VERSION, Kind.LEASE_GRANT),
              msgpack.packb({"leases": [lease]})]
    grant, _ = codec.decode(frames)
    assert grant.leases[0].meta == _nested(31) and grant.leases[0].columns == {"rows": [[{"x": 1}]]}
    beat, _ = codec.decode(codec.encode(protocol.Heartbeat(counters={"n": 3, "s": 1.5})))
    assert beat.counters == {"n": 3, "s": 1.5} and type(beat.counters["n"]) is int


@pytest.mark.parametrize("dtype", [["int32"], {"a": 1}, 7, None])
def test_a_tensor_spec_with_a_non_string_dtype_is_malformed(dtype: object) -> None:
    header = {"tensors": [{"name": "x", "dtype": dtype, "shape": [1], "frame": 0}]}
    frames = [framing.PREAMBLE.pack(framing.MAGIC, PROTOCOL_VERSION, Kind.HEARTBEAT), msgpack.packb(header), b"1234"]
    with pytest.raises(ProtocolError) as caught:
        codec.decode(frames)
    assert caught.value.code == "malformed" and "is not one of" in str(caught.value)


def test_a_newer_peers_unknown_fields_are_ignored_and_said() -> None:
    """Within one protocol version: unknown fields (top level or nested) are dropped and the envelope says so; a
    header without a newer defaulted field decodes with its default (the compatibility rule)."""
    grant = {"leases": [_lease_fields(priority=3)], "reason": "", "from_the_future": {"x": [1]}}
    frames = [framing.PREAMBLE.pack(framing.MAGIC, PROTOCOL_VERSION, Kind.LEASE_GRANT), msgpack.packb(grant)]
    record, envelope = codec.decode(frames)
    assert envelope.unknown_fields and record.leases[0].group_id == "0:1" and record.leases[0].answer == ""
    again, envelope = codec.decode(codec.encode(record))
    assert again == record and not envelope.unknown_fields
    # an unknown field does not hide a bad known one
    grant["leases"][0]["group_size"] = 0
    frames[1] = msgpack.packb(grant)
    with pytest.raises(ProtocolError, match=r"LeaseGrant.leases\[0\].group_size: must be >= 1"):
        codec.decode(frames)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_a_header_cut_short_after_an_unknown_field_is_not_valid_msgpack(message) -> None:
    """An unknown field first and the header cut anywhere after it (the broker's fuzzer found this): the strict
    decoder stops at the unknown name, the lenient one at the cut; a ProtocolError either way, never another
    exception (which the broker answered ``internal`` without counting the message)."""
    header = msgpack.packb({"": 1, **msgpack.unpackb(codec.encode(message)[1])})
    preamble = framing.PREAMBLE.pack(framing.MAGIC, PROTOCOL_VERSION, message.KIND)
    for cut in range(3, len(header)):
        with pytest.raises(ProtocolError, match="not valid msgpack"):
            codec.decode([preamble, header[:cut]])


@settings(max_examples=200, deadline=None)
@given(message=st.sampled_from(SAMPLES), extra=st.dictionaries(st.text(min_size=1, max_size=12).filter(
    lambda k: k != "tensors"), json_values, min_size=1, max_size=4))
def test_any_extra_fields_decode_to_the_same_record(message, extra: dict) -> None:
    """Unknown fields added to any valid header change nothing but ``unknown_fields`` (known names keep theirs)."""
    frames = codec.encode(message)
    header = msgpack.unpackb(frames[1])
    frames[1] = msgpack.packb({**{k: v for k, v in extra.items() if k not in header}, **header})
    record, envelope = codec.decode(frames)
    assert record == message
    assert envelope.unknown_fields == any(k not in header for k in extra)
