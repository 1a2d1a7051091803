"""An adapter the engine refuses ends the worker: exit 2 (not restarted), one log line with the engine's reason.

Before, the worker counted the failure and went on at its old version, so the broker answered every lease
request with ``stale_adapter`` and the worker fetched the same adapter again: a livelock that generated nothing.
Here a stand-in learner publishes, through a real broker, a correctly checksummed adapter whose LoRA tensors
were shaped for another model (the transfer is fine; the hf engine cannot load it), and a real hf worker joins.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.join_time import adapter_message, lora_layout, worker_argv
from loraflow.common.protocol import Ack, Error, Hello, Kind
from loraflow.common.transport import BrokerLink, Incoming
from tests.support import Processes, child_env, start_broker, wait_for


def publish(endpoint: str, update, tensors, token: str) -> None:
    link = BrokerLink(endpoint, Hello(role="learner", client_id="misfit-learner", token=token), heartbeat_interval_s=0.5,
                      heartbeat_timeout_s=10.0)
    try:
        link.start(timeout_s=30)
        link.send(update, tensors)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            item = link.recv(timeout_s=1)
            if isinstance(item, Incoming) and isinstance(item.record, Ack | Error):
                assert isinstance(item.record, Ack) and item.record.ref_kind == Kind.ADAPTER_UPDATE, item.record
                return
        raise AssertionError("the broker did not acknowledge the adapter")
    finally:
        link.close("done")


def test_a_refused_adapter_stops_the_worker_with_exit_2_and_the_reason(procs: Processes, tiny_model_dir: Path) -> None:
    broker = start_broker(procs, f'model.path="{tiny_model_dir}"', "run.group_size=2", "run.groups_per_step=2")
    layout, config = lora_layout(tiny_model_dir)
    misfit = [(name, (shape[0], shape[1] * 2) if "lora_A" in name else shape) for name, shape in layout]
    publish(broker.endpoint, *adapter_message(1, misfit, config), broker.run_token)  # a wider hidden size than the tiny model's
    wait_for(lambda: broker.stats()["latest_version"] == 1, 30, "the broker to hold v1", procs)

    worker = procs.spawn("worker", worker_argv(broker.endpoint, broker.run_dir, "w1", tiny_model_dir),
                         env=child_env())
    assert worker.wait(120) == 2, worker.log()[-3000:]
    events = [json.loads(line) for line in worker.log().splitlines() if line.startswith("{")]
    refused = [e for e in events if e["event"] == "adapter_refused"]
    assert len(refused) == 1, worker.log()[-3000:]
    assert refused[0]["level"] == "error" and refused[0]["version"] == 1
    assert "the hf backend refused adapter v1: adapter v1 does not fit the model" in refused[0]["error"]
    assert "model.path" in refused[0]["fix"]
    assert not any(e["event"] == "adapter_loaded" for e in events)
    assert "Traceback" not in worker.log()
    assert not any(e["event"] == "group_submitted" for e in events)  # nothing generated under the old version
