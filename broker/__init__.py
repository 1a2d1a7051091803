"""The broker: one process between rollout workers and the learner.

Its state, each piece with one owner:

    groups    every prompt's and group's life: the group ledger (ledger), over its stores: the cursor,
              prompt states and lease table (prompts) and the bounded rollout buffer (buffer)
    replies   every reply until zmq takes it, and the parked long-polls (outbox)
    adapters  the kept adapter versions and the notices not yet sent (adapters)
    peers     the client registry, liveness and the heartbeat fast path (peers)
    training  where the run stands and what a restarted learner is reconciled with (history)
    integrity which worker processes are quarantined (quarantine)
    on disk   the state file and the newest adapter (state; restore maps the parts to and from it)
    observed  counters, rates and loop times (stats); the Stats reply read off the parts (snapshot)

:mod:`loraflow.broker.core` dispatches each message (:mod:`loraflow.broker.dispatch`: role checks,
validate-then-apply) to a thin handler over the desks that decide: :mod:`loraflow.broker.leasing`
(credit-based admission, :mod:`loraflow.broker.admission`), :mod:`loraflow.broker.groups` (rollout groups),
:mod:`loraflow.broker.batching` (batches, acks, quarantine hooks), :mod:`loraflow.broker.adapters` (the relay)
and :mod:`loraflow.broker.registration` (hellos, byes, deaths, the learner's restarts).
:mod:`loraflow.broker.server` is the zmq event loop around it; :mod:`loraflow.broker.main` the entry point.
The broker never imports torch: tensor frames pass through as received ``zmq.Frame`` objects.
"""
