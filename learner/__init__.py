"""The learner: trains a LoRA adapter on rollout groups from the broker and publishes each new version.

One logical trainer, R ranks under ``torchrun`` (or one process without it). Rank 0 is the only rank that
talks to the broker. Modules, each owning one thing:

- :mod:`loraflow.learner.parallel`   process group, device, device mesh and the small collectives of the loop
- :mod:`loraflow.learner.model`      base model (frozen) + peft LoRA (trainable), wrapped with FSDP2 ``fully_shard``
- :mod:`loraflow.learner.loss`       pure functions: group advantages, token-level PPO-clip with off-policy correction
- :mod:`loraflow.learner.data`       rollout groups -> filtered step batch -> padded micro-batches per rank
- :mod:`loraflow.learner.session`    rank 0's conversation with the broker (batch requests, acks, adapter publishing)
- :mod:`loraflow.learner.publish`    LoRA tensors gathered to rank 0, PEFT names, checksum, atomic PEFT directories
- :mod:`loraflow.learner.checkpoint` torch.distributed.checkpoint saves and exact resume
- :mod:`loraflow.learner.step`       one optimizer step: micro-batches, loss, backward, clip, AdamW (+ the optimizer)
- :mod:`loraflow.learner.train`      the loop that ties them together (``run(config)``)
"""
