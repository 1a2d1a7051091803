"""A pool broker: several runs' cores behind one socket, each connection in the run its Hello named.

Driven in-process with real encoded messages (as tests/broker/harness.py does for one core): submitted runs are
found on disk, refused with the key named, isolated (a lease, an adapter version, a learner token of one run
mean nothing to another), cancelled one at a time, and restored after a restart.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from loraflow.broker.core import BrokerCore
from loraflow.broker.main import run_core
from loraflow.broker.pool import BrokerPool
from loraflow.common import codec, pool_runs, protocol
from loraflow.common.config import load_config
from loraflow.common.protocol import Hello, LeaseRequest, StatsRequest
from loraflow.common.tasks import load_task
from tests.broker.clients import make_adapter, make_group

A_WORKER, B_WORKER, A_LEARNER, OWN_WORKER = b"worker/wa", b"worker/wb", b"learner/learner-a", b"worker/w0"


class Pool:
    def __init__(self, run_dir: Path) -> None:
        self.config = load_config(None, [f"run.run_dir={run_dir}", "broker.pool=true", "run.group_size=2",
                                         "run.groups_per_step=2", "broker.lease_timeout_s=10"])
        self.now = 1000.0
        own = BrokerCore(self.config, task=load_task("arith", 0), vocab_size=200,
                         state_path=run_dir / "broker" / "state.json", now_s=self.now)
        self.pool = BrokerPool(own, runs_dir=pool_runs.runs_dir(self.config),
                               make_core=lambda run_id: run_core(self.config, run_id, vocab_size=200))

    def flush(self) -> list[tuple[bytes, Any]]:
        replies, deadline = [], time.monotonic() + 10
        while True:
            self.pool.tick(self.now)
            replies += [(out.identity, codec.decode(out.frames)[0]) for out in self.pool.flush(self.now)]
            if not any(c.outbox.num_awaiting for c in self.pool.cores.values()) and not self.pool.has_work(self.now):
                return replies
            assert time.monotonic() < deadline, "a state write did not finish"
            time.sleep(0.001)

    def send(self, identity: bytes, record: Any, tensors: Any = ()) -> list[Any]:
        self.pool.handle(identity, codec.encode(record, list(tensors)), self.now)
        return [r for i, r in self.flush() if i == identity]

    def hello(self, identity: bytes, run: str, **kwargs: Any) -> Any:
        role, client_id = identity.decode().split("/")
        return self.send(identity, Hello(role=role, client_id=client_id, run=run, session="s1", **kwargs))[0]

    def lease(self, identity: bytes, n: int = 1) -> protocol.LeaseGrant:
        return self.send(identity, LeaseRequest(max_leases=n, wait_ms=0))[0]

    def rescan(self) -> None:
        self.now += 2.0
        self.flush()


def submit(run_dir: Path, run_id: str, text: str) -> Path:
    directory = run_dir / "runs" / run_id
    directory.mkdir(parents=True)
    (directory / pool_runs.SUBMITTED).write_text(text)
    return directory


@pytest.fixture
def pool(tmp_path: Path) -> Pool:
    submit(tmp_path, "a", "[run]\nseed = 1\n")
    submit(tmp_path, "b", "[run]\nseed = 2\ngroup_size = 4\n[learner]\nlr = 3e-4\n")
    pool = Pool(tmp_path)
    pool.rescan()
    return pool


def test_submitted_runs_get_cores_with_their_own_settings(pool: Pool, tmp_path: Path) -> None:
    assert sorted(pool.pool.cores) == ["", "a", "b"]
    b = pool.pool.cores["b"].config
    assert (b.run.group_size, b.learner.lr, b.run.pool_run, b.run.run_dir) == (4, 3e-4, "b", str(tmp_path / "runs/b"))
    assert (tmp_path / "runs/b" / pool_runs.RESOLVED).is_file()
    assert pool.hello(B_WORKER, "b").group_size == 4
    assert pool.hello(A_WORKER, "a").group_size == 2


def test_a_run_setting_what_the_pool_owns_is_refused_with_the_key(pool: Pool, tmp_path: Path) -> None:
    submit(tmp_path, "bad", "[model]\npath = 'elsewhere'\n[worker]\nbackend = 'sim'\n")
    pool.rescan()
    assert "bad" not in pool.pool.cores
    why = (tmp_path / "runs/bad" / pool_runs.REFUSED).read_text()
    assert "model, worker.backend are the pool's" in why
    assert pool.hello(A_WORKER, "bad").code == "unknown_run"


def test_each_run_leases_its_own_prompts_and_a_worker_can_only_submit_its_own_run_leases(pool: Pool) -> None:
    pool.hello(A_WORKER, "a")
    pool.hello(B_WORKER, "b")
    pool.hello(OWN_WORKER, "")
    a_lease = pool.lease(A_WORKER).leases[0]
    b_lease = pool.lease(B_WORKER).leases[0]
    own_lease = pool.lease(OWN_WORKER).leases[0]
    assert (a_lease.group_size, b_lease.group_size) == (2, 4)
    assert a_lease.prompt != b_lease.prompt  # seeds 1 and 2: each run's own prompt source
    # the worker of run a names run b's lease: its run's ledger never granted it
    record, tensors = make_group(b_lease, "wa")
    assert pool.send(A_WORKER, record, tensors)[0].code == "unknown_lease"
    record, tensors = make_group(a_lease, "wa")
    assert pool.send(A_WORKER, record, tensors)[0].status == "accepted"
    assert len(pool.pool.cores["a"].ledger.buffered()) == 1
    assert not pool.pool.cores["b"].ledger.buffered() and not pool.pool.default.ledger.buffered()
    assert own_lease.group_id == a_lease.group_id  # same (epoch, index) in two runs: two ledgers, no clash


def test_a_connection_stays_in_the_run_it_joined(pool: Pool) -> None:
    pool.hello(A_WORKER, "a")
    assert pool.hello(A_WORKER, "b").code == "forbidden"
    assert pool.pool.cores["b"].peers.get(A_WORKER) is None
    assert pool.hello(A_WORKER, "nope").code == "unknown_run"


def test_adapter_lineages_and_learner_tokens_are_per_run(pool: Pool, tmp_path: Path) -> None:
    token_a = (tmp_path / "runs/a/broker/run_token").read_text().strip()
    token_b = (tmp_path / "runs/b/broker/run_token").read_text().strip()
    assert token_a != token_b
    assert pool.hello(b"learner/thief", "b", token=token_a).code == "forbidden"
    assert pool.hello(A_LEARNER, "a", token=token_a).KIND == protocol.Kind.WELCOME
    record, tensors = make_adapter(1)
    assert pool.send(A_LEARNER, record, tensors)[0].version == 1
    assert pool.pool.cores["a"].latest_version == 1
    assert pool.pool.cores["b"].latest_version == 0 and pool.pool.default.latest_version == 0


def test_stats_name_their_run(pool: Pool) -> None:
    pool.hello(B_WORKER, "b")
    stats = pool.send(b"observer/o1", StatsRequest(run="b"))[0]
    assert stats.snapshot["num_workers"] == 1
    assert pool.send(b"observer/o2", StatsRequest(run=""))[0].snapshot["num_workers"] == 0
    assert pool.send(b"observer/o3", StatsRequest(run="zz"))[0].code == "unknown_run"


def test_cancel_stops_one_run_leasing_and_leaves_the_others(pool: Pool, tmp_path: Path) -> None:
    pool.hello(A_WORKER, "a")
    pool.hello(B_WORKER, "b")
    (tmp_path / "runs/a" / pool_runs.CANCELLED).write_text("by test\n")
    pool.rescan()
    assert pool.pool.cancelled == {"a"}
    refused = pool.lease(A_WORKER)
    assert (refused.leases, refused.reason) == ([], "draining")
    assert len(pool.lease(B_WORKER).leases) == 1


def test_a_restarted_pool_broker_continues_every_run(pool: Pool, tmp_path: Path) -> None:
    token_a = (tmp_path / "runs/a/broker/run_token").read_text().strip()
    pool.hello(A_LEARNER, "a", token=token_a)
    record, tensors = make_adapter(1)
    pool.send(A_LEARNER, record, tensors)
    pool.hello(B_WORKER, "b")
    leased = pool.lease(B_WORKER, n=2).leases
    restarted = Pool(tmp_path)
    restarted.rescan()
    assert sorted(restarted.pool.cores) == ["", "a", "b"]
    assert restarted.pool.cores["a"].latest_version == 1
    # run b's two leased prompts are queued again, ahead of its cursor; run a's ledger never saw them
    regranted = restarted.lease(B_WORKER, n=2) if restarted.hello(B_WORKER, "b") else None
    assert {lease.group_id for lease in regranted.leases} == {lease.group_id for lease in leased}


def test_a_run_with_an_empty_dataset_is_refused_and_the_others_go_on(pool: Pool, tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    submit(tmp_path, "empty", f"[run]\ntask = '{empty}'\n")
    pool.rescan()
    assert "empty" not in pool.pool.cores
    assert "the file is empty" in (tmp_path / "runs/empty" / pool_runs.REFUSED).read_text()
    pool.hello(A_WORKER, "a")
    assert len(pool.lease(A_WORKER).leases) == 1
