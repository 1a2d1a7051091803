"""The broker's limits, each reached on purpose against a real broker process, each with an error that says
which setting to change, and the broker serving on:

- ``broker.max_message_bytes``: a client never sends a message over the limit its Welcome announced
  (:class:`loraflow.common.transport.MessageTooLarge`); a worker whose group is too large returns the lease, counts and
  logs it and goes on. (A message over the limit sent anyway is refused with ``oversize``, and a single frame
  over it makes zmq drop the connection: tests/broker/test_bad_input.py.)
- ``broker.max_workers``: one worker too many is refused at its Hello; the worker process exits 1 saying so.
- ``broker.max_leases_per_worker``: a worker asking for more gets at most that many, with the reason ``limit``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loraflow.common.transport import MessageTooLarge
from tests.broker.clients import Worker, make_group
from tests.fault.ledger import read_json_lines
from tests.support import Processes, start_broker, wait_for

LIMIT = 64 << 10


def test_a_message_over_the_size_limit_is_never_sent(procs: Processes) -> None:
    broker = start_broker(procs, "run.group_size=2", f"broker.max_message_bytes={LIMIT}")
    worker = Worker(broker.endpoint, "w1")
    try:
        assert worker.welcome.max_message_bytes == LIMIT
        lease, = worker.lease(1).leases
        record, tensors = make_group(lease, "w1", completion_len=4000)  # 2 samples x 4000 tokens x 13 bytes
        with pytest.raises(MessageTooLarge, match=r"ROLLOUT_GROUP message of \d+ bytes exceeds the broker's limit "
                                                  r"of 65536 bytes \(broker.max_message_bytes\)"):
            worker.link.send(record, tensors)
        worker.submit(lease, completion_len=100)  # the same lease, a group that fits
        assert worker.reply().status == "accepted"
        stats = broker.stats()
        assert stats["messages_in"].get("rollout_group") == 1 and stats["num_rejected"] == 0
    finally:
        worker.close()


def test_a_worker_with_groups_too_large_returns_their_leases(procs: Processes, tmp_path: Path) -> None:
    broker = start_broker(procs, "run.group_size=4", f"broker.max_message_bytes={LIMIT}", "broker.prompt_limit=4",
                          "broker.num_epochs=1")
    worker = procs.python("worker", "loraflow.rollout_worker", "--endpoint", broker.endpoint, "--backend", "sim",
                          "--worker-id", "big", "--log-format", "json", "--set", "worker.max_new_tokens=4096",
                          "--set", "worker.chunk_tokens=4096", "--set", "worker.sim.mean_tokens=2000",
                          "--set", "worker.sim.length_sigma=0", "--set", "worker.sim.tokens_per_s=1e6",
                          "--set", "worker.capacity=2", "--set", "model.max_seq_len=4096")

    def returned() -> int:
        return broker.stats()["lease_events"].get("returned", 0)

    wait_for(lambda: returned() >= 3, 30, "leases of oversized groups returned", procs)
    stats = broker.stats()
    assert stats["group_events"] == {} and stats["num_rejected"] == 0  # nothing oversized reached the broker
    assert worker.alive()
    errors = [line for line in read_json_lines(worker.log_path) if line.get("event") == "group_too_large"]
    assert errors and "broker.max_message_bytes" in errors[0]["error"] and "worker.max_new_tokens" in errors[0]["fix"]
    assert worker.stop() == 0


def test_one_worker_too_many_is_refused_and_told_why(procs: Processes) -> None:
    broker = start_broker(procs, "broker.max_workers=2")
    sim = ["--endpoint", broker.endpoint, "--backend", "sim", "--log-format", "json",
           "--set", "worker.sim.tokens_per_s=50"]
    first, second = (procs.python(f"worker-{i}", "loraflow.rollout_worker", *sim, "--worker-id", f"w{i}") for i in (1, 2))
    wait_for(lambda: len(broker.stats()["workers"]) == 2, 30, "two workers registered", procs)
    third = procs.python("worker-3", "loraflow.rollout_worker", *sim, "--worker-id", "w3")
    assert third.wait(30) == 1
    refusal, = [line for line in read_json_lines(third.log_path) if line.get("event") == "broker_refused"]
    assert "(limit): 2 workers are registered (broker.max_workers)" in refusal["error"]
    stats = broker.stats()
    assert stats["rejected"] == {"limit": 1} and sorted(w["id"] for w in stats["workers"]) == ["w1", "w2"]
    assert first.alive() and second.alive()
    assert first.stop() == 0 and second.stop() == 0


def test_leases_per_worker_are_capped(procs: Processes) -> None:
    broker = start_broker(procs, "run.group_size=2", "broker.max_leases_per_worker=2")
    worker = Worker(broker.endpoint, "w1")
    try:
        grant = worker.lease(5)
        assert len(grant.leases) == 2 and grant.reason == "limit"
        worker.submit(grant.leases[0])
        assert worker.reply().status == "accepted"
        grant = worker.lease(5)
        assert len(grant.leases) == 1 and grant.reason == "limit"
        assert broker.stats()["leases"]["outstanding"] == 2
    finally:
        worker.close()
