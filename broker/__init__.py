"""The broker: one process between rollout workers and the learner.

Its state, each piece with one owner: every prompt's and group's life in the group ledger
(:mod:`loraflow.broker.ledger`, over the cursor :mod:`loraflow.broker.prompts`, the leases :mod:`loraflow.broker.leases` and the bounded
rollout buffer :mod:`loraflow.broker.buffer`), every reply's in the outbox (:mod:`loraflow.broker.outbox`), where the run stands
(:mod:`loraflow.broker.progress`), the kept adapters (:mod:`loraflow.broker.adapters`), the client registry
(:mod:`loraflow.broker.peers`), the training history a restarted learner is reconciled with (:mod:`loraflow.broker.history`),
worker quarantine (:mod:`loraflow.broker.quarantine`), persisted state (:mod:`loraflow.broker.state`, :mod:`loraflow.broker.restore`)
and stats (:mod:`loraflow.broker.stats`, :mod:`loraflow.broker.snapshot`).

:mod:`loraflow.broker.core` dispatches each message (:mod:`loraflow.broker.dispatch`: role checks, validate-then-apply) to a
thin handler over the desks that decide: :mod:`loraflow.broker.leasing` (credit-based admission,
:mod:`loraflow.broker.admission`), :mod:`loraflow.broker.intake` (rollout groups), :mod:`loraflow.broker.batching` (batches, acks,
quarantine hooks), :mod:`loraflow.broker.relay` (adapters) and :mod:`loraflow.broker.registration` (hellos, the learner's
restarts). :mod:`loraflow.broker.server` is the zmq event loop around it; :mod:`loraflow.broker.main` the entry point.
The broker never imports torch: tensor frames pass through as received ``zmq.Frame`` objects.
"""
