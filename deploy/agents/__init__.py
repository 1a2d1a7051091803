"""Example agent harnesses for worker.agent (see rollout_worker/gateway)."""
