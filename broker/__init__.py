"""The broker: one process between rollout workers and the learner.

Its state, each piece with one owner: every prompt's and group's life in the group ledger
(:mod:`broker.ledger`, over the cursor :mod:`broker.prompts`, the leases :mod:`broker.leases` and the bounded
rollout buffer :mod:`broker.buffer`), every reply's in the outbox (:mod:`broker.outbox`), where the run stands
(:mod:`broker.progress`), the kept adapters (:mod:`broker.adapters`), the client registry
(:mod:`broker.peers`), the training history a restarted learner is reconciled with (:mod:`broker.history`),
worker quarantine (:mod:`broker.quarantine`), persisted state (:mod:`broker.state`, :mod:`broker.restore`)
and stats (:mod:`broker.stats`, :mod:`broker.snapshot`).

:mod:`broker.core` dispatches each message (:mod:`broker.dispatch`: role checks, validate-then-apply) to a
thin handler over the desks that decide: :mod:`broker.leasing` (credit-based admission,
:mod:`broker.admission`), :mod:`broker.intake` (rollout groups), :mod:`broker.batching` (batches, acks,
quarantine hooks), :mod:`broker.relay` (adapters) and :mod:`broker.registration` (hellos, the learner's
restarts). :mod:`broker.server` is the zmq event loop around it; :mod:`broker.main` the entry point.
The broker never imports torch: tensor frames pass through as received ``zmq.Frame`` objects.
"""
