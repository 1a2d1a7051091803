"""Rollout workers: lease prompt groups from the broker, generate and score them, submit them.

Layout: :mod:`.worker` (the loop), :mod:`.client` (the broker session), :mod:`.rollout` (samples, chunk rounds,
partial-rollout policy), :mod:`.adapters` (received adapters on disk), :mod:`.backends` (hf, vllm, sim),
:mod:`.envs` (single-turn and tool tasks), :mod:`.rewards` (guarded user code). Imports only ``common``.
"""
