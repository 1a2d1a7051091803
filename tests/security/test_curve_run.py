"""A real run with CURVE on: keys from ``loraflow keys``, a broker, a sim worker and a learner, while strangers
and a worker key posing as the learner try their luck. They are refused and counted, and the run goes on.

- a key the broker never authorised (it knows the broker's public key) and a client without CURVE: the handshake
  fails, not one message reaches the broker, the refused handshake is counted (``auth{refused}``);
- the worker key under the identity a learner would have without CURVE (``learner/learner``): saying Hello as a
  learner, asking for a batch, acknowledging one and publishing an adapter are all refused (``forbidden``), and
  it receives nothing meant for the learner: a CURVE client's identity carries a random route token, so an
  authorised key cannot take over another client's route;
- meanwhile the learner keeps training, the worker keeps generating, and everything stops cleanly.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import zmq

from loraflow.common import codec, protocol, sockets
from loraflow.common.protocol import BatchAck, BatchRequest, Error, Hello, Kind
from loraflow.common.security import ClientSecurity, generate_keys
from loraflow.common.transport import fetch_stats
from tests.broker.clients import make_adapter
from tests.fault.system import System, write_config
from tests.support import REPO, Processes, child_env, wait_for

NUM_PROMPTS = 4096  # more than the run gets through: it is stopped, not finished


def make_keys(directory: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "loraflow.deploy.cli", "keys", str(directory)], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert {p.name for p in (directory / "authorized").iterdir()} == {"worker", "learner", "observer"}


class Intruder:
    """A DEALER with whatever key and identity it is given, collecting everything it receives."""

    def __init__(self, ctx: zmq.Context, endpoint: str, identity: bytes, security: ClientSecurity | None) -> None:
        self.sock = sockets.dealer_socket(ctx, endpoint, identity=identity, security=security)
        self.received: list = []

    def ask(self, record, tensors=(), timeout_s: float = 3.0):
        """Send and wait for the answer; None when nothing comes back (or nothing could even be sent: a DEALER
        whose handshake failed has no peer to queue for)."""
        try:
            self.sock.send_multipart(codec.encode(record, list(tensors)), flags=zmq.NOBLOCK)
        except zmq.Again:
            return None
        return self.next(timeout_s)

    def next(self, timeout_s: float):
        """The next answer; what a registered worker gets unasked (adapters, notices) is only recorded."""
        while self.sock.poll(int(timeout_s * 1000)):
            record, _ = codec.decode(self.sock.recv_multipart())
            self.received.append(record)
            if record.KIND not in (Kind.HEARTBEAT, Kind.ADAPTER_UPDATE, Kind.ADAPTER_NOTICE):
                return record
        return None


@pytest.mark.slow
def test_strangers_and_wrong_roles_are_refused_while_the_run_goes_on(procs: Processes, tmp_path: Path,
                                                                     tiny_model_dir: Path) -> None:
    keys = tmp_path / "keys"
    make_keys(keys)
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "run.toml", run_dir=run_dir, model_dir=tiny_model_dir, backend="sim",
                          num_prompts=NUM_PROMPTS, checkpoint_every=5,
                          extra=f'[security]\nenabled = true\nkeys_dir = "{keys}"\n')
    system = System(procs, config, run_dir, num_workers=1)
    system.start()
    observer = ClientSecurity.load(keys, "observer")

    def stats() -> dict:
        return fetch_stats(system.endpoint, timeout_s=5, security=observer)

    wait_for(lambda: system.ledger_steps() >= 2, 90, "the learner's first steps", procs)
    ctx = zmq.Context()
    try:
        # strangers: a key nobody authorised, and no CURVE at all
        generate_keys(tmp_path / "elsewhere", {"mallory": "learner"})
        mallory = ClientSecurity.load(tmp_path / "elsewhere", "mallory")
        mallory.broker_public = observer.broker_public
        for security in (mallory, None):
            stranger = Intruder(ctx, system.endpoint, f"learner/{uuid.uuid4().hex[:6]}".encode(), security)
            assert stranger.ask(Hello(role="learner", client_id="mallory", session="m")) is None
            assert stranger.ask(protocol.StatsRequest(), timeout_s=1.0) is None
        wait_for(lambda: stats()["auth"].get("refused", 0) >= 1, 10, "the refused handshake to be counted", procs)

        # the worker key under the learner's plain identity: every learner action refused, nothing of the learner's
        impostor = Intruder(ctx, system.endpoint, b"learner/learner", ClientSecurity.load(keys, "worker"))
        refused = impostor.ask(Hello(role="learner", client_id="learner", session=uuid.uuid4().hex))
        assert isinstance(refused, Error) and refused.code == "forbidden" and "authorised as a worker" in refused.message
        welcome = impostor.ask(Hello(role="worker", client_id="impostor", session=uuid.uuid4().hex))
        assert welcome.KIND == Kind.WELCOME
        attempts = [BatchRequest(num_groups=4, wait_ms=0),
                    BatchAck(batch_id=f"{welcome.broker_id}.1", step=1, trained_version=0, group_ids=["0:0"]),
                    make_adapter(welcome.latest_version + 1)]
        for attempt in attempts:
            record, tensors = attempt if isinstance(attempt, tuple) else (attempt, ())
            error = impostor.ask(record, tensors)
            assert isinstance(error, Error) and error.code == "forbidden", error
        before = system.ledger_steps()
        wait_for(lambda: system.ledger_steps() >= before + 3, 60, "the learner to train on", procs)
        impostor.next(timeout_s=0.5)
        kinds = {r.KIND for r in impostor.received}
        assert not kinds & {Kind.BATCH, Kind.ACK}, kinds  # nothing routed to the learner (adapters go to workers)

        # the impostor, silent since, is declared dead after the heartbeat timeout (3 steps may take less on a fast
        # machine); route tokens are never shown
        def only_the_worker_listed() -> dict | None:
            snapshot = stats()
            return snapshot if [w["identity"] for w in snapshot["workers"]] == ["worker/w1"] else None

        snapshot = wait_for(only_the_worker_listed, 30, "the silent impostor to be declared dead", procs)
        assert snapshot["rejected"] == {"forbidden": 4}, snapshot["rejected"]
        assert snapshot["auth"]["refused"] >= 1
        assert snapshot["learner"]["identity"] == "learner/learner"
    finally:
        ctx.destroy(linger=0)
    system.stop()  # everything stops cleanly: exit code 0 for the learner, the worker and the broker
