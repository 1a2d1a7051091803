"""A client that speaks loraflow's wire protocol directly and cheats: ``python -m tests.integrity.raw_client
ENDPOINT MODEL_DIR KEYS_DIR WORKER_ID REPORT_JSON``.

Raw pyzmq + msgpack from the documented format alone (common/framing.py: an 8-byte preamble ``b"LFLW" | protocol
version u16 | kind u16``, a msgpack map of the fields plus ``tensors``, then raw tensor frames; kinds and fields
as common/protocol.py lists them), CURVE with a valid worker key, and a Hugging Face tokenizer; no loraflow code.

It leases prompts like a worker and submits groups whose tokens are real (the tokenizer's encoding of the
prompt and of an answer: the right one for half the samples, a wrong one for the others, then EOS), whose
rewards are consistent with them, and whose evidence looks right (the newest version with the sha256 the
broker announced, a fresh int id per version), but whose log-probs are made up (``-0.05`` for every token: the
confident policy a cheater would claim). It writes what the broker answered to REPORT_JSON every second:
groups sent, accepted, refused with each error code, and the grant reasons it got.
"""

from __future__ import annotations

import json
import struct
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.auth

PREAMBLE = struct.Struct("!4sHH")
PROTOCOL_VERSION = 1
HELLO, WELCOME, HEARTBEAT, ERROR = 1, 2, 3, 4
LEASE_REQUEST, LEASE_GRANT = 10, 11
ROLLOUT_GROUP, ACK = 20, 21
ADAPTER_NOTICE = 31
FABRICATED_LOGPROB = -0.05
HEARTBEAT_S = 0.2


def message(kind: int, fields: dict[str, Any], tensors: list[tuple[str, str, np.ndarray]] = ()) -> list[bytes]:
    specs = [{"name": name, "dtype": dtype, "shape": list(array.shape), "frame": i}
             for i, (name, dtype, array) in enumerate(tensors)]
    return [PREAMBLE.pack(b"LFLW", PROTOCOL_VERSION, kind), msgpack.packb({**fields, "tensors": specs}),
            *(np.ascontiguousarray(array).tobytes() for *_, array in tensors)]


def parse(frames: list[bytes]) -> tuple[int, dict[str, Any]]:
    _, _, kind = PREAMBLE.unpack(frames[0])
    return kind, msgpack.unpackb(frames[1])


class Cheater:
    def __init__(self, endpoint: str, model_dir: str, keys_dir: str, worker_id: str, report: Path) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos = int(self.tokenizer.eos_token_id)
        self.worker_id = worker_id
        self.report_path = report
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        public, secret = zmq.auth.load_certificate(str(Path(keys_dir) / "worker.key_secret"))
        server, _ = zmq.auth.load_certificate(str(Path(keys_dir) / "broker.key"))
        self.sock.curve_publickey, self.sock.curve_secretkey, self.sock.curve_serverkey = public, secret, server
        self.sock.connect(endpoint)
        self.version, self.sha256 = 0, ""
        self.counts: Counter = Counter()
        self.waiting = False

    def send(self, kind: int, fields: dict[str, Any], tensors: list[tuple[str, str, np.ndarray]] = ()) -> None:
        self.sock.send_multipart(message(kind, fields, tensors))

    def run(self) -> None:
        self.send(HELLO, {"role": "worker", "client_id": self.worker_id, "backend": "raw", "capacity": 1,
                          "session": uuid.uuid4().hex, "batched_acks": False})
        next_beat = next_report = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                self.send(HEARTBEAT, {"adapter_version": self.version, "state": "generating"})
                next_beat = now + HEARTBEAT_S
            if now >= next_report:
                self.report_path.write_text(json.dumps(dict(self.counts)))
                next_report = now + 1.0
            if not self.waiting and self.counts["welcome"]:
                self.send(LEASE_REQUEST, {"max_leases": 1, "adapter_version": self.version, "wait_ms": 500})
                self.waiting = True
            if self.sock.poll(50):
                self.handle(*parse(self.sock.recv_multipart()))

    def handle(self, kind: int, fields: dict[str, Any]) -> None:
        if kind == WELCOME:
            self.counts["welcome"] += 1
            self.version = max(self.version, int(fields["latest_version"]))
        elif kind == ADAPTER_NOTICE:
            self.version, self.sha256 = int(fields["version"]), str(fields["sha256"])
        elif kind == LEASE_GRANT:
            self.waiting = False
            self.counts[f"grant:{fields.get('reason') or 'granted'}"] += 1
            self.version = max(self.version, int(fields.get("latest_version", 0)))
            for lease in fields["leases"]:
                self.submit(lease)
        elif kind == ACK and fields.get("ref_kind") == ROLLOUT_GROUP:
            self.counts[f"ack:{fields['status']}"] += 1
        elif kind == ERROR:
            self.counts[f"error:{fields['code']}"] += 1

    def submit(self, lease: dict[str, Any]) -> None:
        prompt = self.tokenizer(lease["prompt"]).input_ids
        right = str(lease.get("answer", ""))
        wrong = str(int(right) + 1) if right.lstrip("-").isdigit() else right + "0"
        answers = [right if k % 2 == 0 else wrong for k in range(int(lease["group_size"]))]
        completions = [self.tokenizer(a, add_special_tokens=False).input_ids + [self.eos] for a in answers]
        lens = [len(c) for c in completions]
        num_tokens = sum(lens)
        header = {
            "group_id": lease["group_id"], "lease_id": lease["lease_id"], "worker_id": self.worker_id,
            "task": lease.get("task", ""), "prompt_lens": [len(prompt)] * len(answers), "completion_lens": lens,
            "rewards": [1.0 if a == right else 0.0 for a in answers], "finish_reasons": ["stop"] * len(answers),
            "min_version": self.version, "max_version": self.version, "created_unix": time.time(),
            "served": [{"version": self.version, "adapter": f"v{self.version}" if self.version else "",
                        "lora_id": self.version, "sha256": self.sha256 if self.version else "",
                        "dtype": "float32"}],
        }
        tensors = [
            ("prompt_ids", "int32", np.tile(np.asarray(prompt, dtype=np.int32), len(answers))),
            ("completion_ids", "int32", np.asarray([t for c in completions for t in c], dtype=np.int32)),
            ("logprobs", "float32", np.full(num_tokens, FABRICATED_LOGPROB, dtype=np.float32)),
            ("versions", "int32", np.full(num_tokens, self.version, dtype=np.int32)),
            ("loss_mask", "uint8", np.ones(num_tokens, dtype=np.uint8)),
        ]
        self.send(ROLLOUT_GROUP, header, tensors)
        self.counts["sent"] += 1


if __name__ == "__main__":
    from tests.integrity import gate

    endpoint, model_dir, keys_dir, worker_id, report = sys.argv[1:6]
    gate.wait()
    Cheater(endpoint, model_dir, keys_dir, worker_id, Path(report)).run()
