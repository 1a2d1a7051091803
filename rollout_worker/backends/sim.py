"""The simulated backend: no model, realistic timing, valid tokens; for measuring orchestration at scale.

Each generation (a sample's turn, named by ``GenRequest.key``) has a target length drawn once from a lognormal
distribution with mean ``sim.mean_tokens`` and shape ``sim.length_sigma`` (0 = fixed), capped at
``sim.max_tokens``: a long tail of slow samples, as real reasoning rollouts have. A call sleeps as long as its
longest request takes at ``sim.tokens_per_s`` (every request is one stream decoding in parallel, as in a
batched engine) and returns token ids in ``[0, sim.vocab_size - 1)``, ending with EOS (``vocab_size - 1``) once a
generation reaches its target, with log-probs that are finite and negative.

Tokens depend on the adapter: greedy output is a hash of the version's checksum, the key and the position, so
tests can tell which adapter produced a token exactly as they do with a real model. Sampled output draws from a
seeded generator. Adapters are only recorded (their files are verified and written by the store as usual);
the evidence of a load (:mod:`.base`) is a load number and the sha256 of the file as read at load time, so a
file changed on disk shows here as on the real backends, though the log-probs are made up (the learner refuses a
sim run with ``integrity.check`` on).
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections.abc import Sequence

from loraflow.common.chat import Prompt
from loraflow.common.config import SimConfig
from loraflow.common.protocol import ServedAdapter
from loraflow.rollout_worker.adapters import WEIGHTS_FILE, ReceivedAdapter, tensors_sha256
from loraflow.rollout_worker.backends.base import Backend, GenOutput, GenRequest, Sampling

BASE_DIGEST = "base"


class SimBackend(Backend):
    name = "sim"

    def __init__(self, config: SimConfig, *, sampling: Sampling, seed: int = 0) -> None:
        super().__init__(sampling)
        self.config = config
        self.seed = seed
        self.vocab_size = config.vocab_size
        self.eos_token_id = config.vocab_size - 1
        self.eos_token_ids = (self.eos_token_id,)
        self._rng = random.Random(seed)
        self._mu = math.log(config.mean_tokens) - config.length_sigma ** 2 / 2  # lognormal with that mean

    # -- tokens (bytes, folded into the vocabulary) --------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        text = prompt if isinstance(prompt, str) else "".join(f"{m['role']}: {m['content']}\n" for m in prompt)
        return [b % self.eos_token_id for b in text.encode()]

    def encode_continuation(self, text: str) -> list[int]:
        return self.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return bytes(t for t in token_ids if t < min(256, self.eos_token_id)).decode(errors="replace")

    # -- adapters ----------------------------------------------------------------------------------------------

    def _load(self, adapter: ReceivedAdapter) -> ServedAdapter:
        """No weights to load: the file the store wrote is read and hashed."""
        return ServedAdapter(version=adapter.version, adapter=f"sim-v{adapter.version}", lora_id=self.new_lora_id(),
                             sha256=tensors_sha256(adapter.path / WEIGHTS_FILE), dtype=self.engine_dtype)

    def _unload(self, version: int) -> None:
        pass

    def digest(self, version: int) -> str:
        return BASE_DIGEST if version == 0 else self.adapters[version].sha256

    # -- generation --------------------------------------------------------------------------------------------

    def target_length(self, key: str) -> int:
        """Tokens the generation named ``key`` runs before EOS (drawn once per key, reproducibly)."""
        draw = random.Random(f"{self.seed}/{key}").lognormvariate(self._mu, self.config.length_sigma)
        return max(1, min(self.config.max_tokens, round(draw)))

    def _token(self, version: int, key: str, position: int) -> tuple[int, float]:
        digest = hashlib.blake2b(f"{self.digest(version)}/{key}/{position}".encode(), digest_size=8).digest()
        value = int.from_bytes(digest, "little")
        return value % self.eos_token_id, -((value >> 32) % 1000 + 1) / 200.0

    def _generate(self, requests: Sequence[GenRequest], greedy: bool) -> list[GenOutput]:
        outputs = []
        for request in requests:
            remaining = self.target_length(request.key) - request.num_generated
            count = max(1, min(request.max_tokens, remaining))
            ids, logprobs = [], []
            for i in range(count):
                if greedy:
                    token, logprob = self._token(request.version, request.key, request.num_generated + i)
                else:
                    token, logprob = self._rng.randrange(self.eos_token_id), -self._rng.expovariate(1.0) - 1e-3
                ids.append(token)
                logprobs.append(logprob)
            finished = count >= remaining
            if finished:
                ids[-1] = self.eos_token_id
            outputs.append(GenOutput(token_ids=ids, logprobs=logprobs, finished=finished))
        time.sleep(max(len(o.token_ids) for o in outputs) / self.config.tokens_per_s)
        return outputs
