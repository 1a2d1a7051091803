"""The learner with the real broker and a scripted producer: it trains, publishes versions in order, acks batches."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np

from common.protocol import AdapterNotice, AdapterUpdate, Error, Hello, LeaseGrant, LeaseRequest
from common.transport import BrokerLink, Incoming
from tests.learner.scripted import make_group
from tests.support import Processes, start_broker, wait_for

NUM_STEPS = 4
RUN = ["run.groups_per_step=2", "run.group_size=4", "run.max_staleness=1", "broker.heartbeat_interval_s=0.2"]


class Producer(threading.Thread):
    """A scripted worker: leases prompts, submits random groups at its adapter version, follows AdapterNotices."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(name="producer", daemon=True)
        self.link = BrokerLink(endpoint, Hello(role="worker", client_id="producer", capacity=8),
                               heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0)
        self.version = 0
        self.notices: list[int] = []
        self.errors: list[Error] = []
        self.stop = threading.Event()

    def run(self) -> None:
        rng = np.random.default_rng(0)
        self.link.start(timeout_s=10)
        asked = False
        while not self.stop.is_set():
            if not asked:
                self.link.send(LeaseRequest(max_leases=4, adapter_version=self.version, wait_ms=200))
                asked = True
            item = self.link.recv(timeout_s=0.1)
            if not isinstance(item, Incoming):
                continue
            record = item.record
            if isinstance(record, LeaseGrant):
                asked = False
                for lease in record.leases:
                    group, tensors = make_group(rng, lease.group_id, group_size=lease.group_size,
                                                min_version=self.version)
                    group.lease_id, group.worker_id = lease.lease_id, "producer"
                    self.link.send(group, tensors)
            elif isinstance(record, AdapterNotice):
                self.notices.append(record.version)
                self.version = max(self.version, record.version)
            elif isinstance(record, AdapterUpdate):
                self.version = max(self.version, record.version)
            elif isinstance(record, Error):
                self.errors.append(record)
        self.link.close()


def test_learner_trains_with_the_real_broker(tiny_model_dir: Path, procs: Processes, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    model = f"model.path=\"{tiny_model_dir}\""
    broker = start_broker(procs, *RUN, model, run_dir=run_dir)
    producer = Producer(broker.endpoint)
    producer.start()
    args = ["--run-dir", str(run_dir), "--endpoint", broker.endpoint, "--num-steps", str(NUM_STEPS)]
    for override in (*RUN, model, "learner.lora_rank=4", "learner.save_adapter_every=0"):
        args += ["--set", override]
    learner = procs.python("learner", "learner", *args)
    try:
        assert learner.popen.wait(timeout=120) == 0, procs.logs()
        wait_for(lambda: producer.notices[-1:] == [NUM_STEPS], 10, "the last adapter notice", procs)
        stats = broker.stats()
    finally:
        producer.stop.set()
        producer.join(timeout=10)
    assert producer.notices == list(range(1, NUM_STEPS + 1))  # every version, in order, relayed to workers
    assert not [e for e in producer.errors if e.code != "limit"], producer.errors
    assert stats["latest_version"] == NUM_STEPS
    assert stats["prompts"]["trained_total"] == NUM_STEPS * 2  # every batch acknowledged, every group trained
    lines = [json.loads(x) for x in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in lines] == list(range(1, NUM_STEPS + 1))
    assert all(m["num_groups"] == 2 and m["num_tokens"] > 0 for m in lines)
    assert all(max(int(k) for k in m["staleness"]) <= 1 for m in lines if m["staleness"])
    assert (run_dir / "learner" / "adapters" / f"v{NUM_STEPS:06d}" / "adapter_config.json").is_file()
    assert "unacknowledged_at_exit" not in learner.log()
