"""The broker: one process between rollout workers and the learner.

It owns the prompt cursor and prompt leases (:mod:`broker.prompts`, :mod:`broker.leases`), credit-based
admission (:mod:`broker.admission`), the bounded rollout buffer (:mod:`broker.buffer`), the adapter relay
(:mod:`broker.adapters`), the client registry (:mod:`broker.peers`), the training history a restarted learner
is reconciled with (:mod:`broker.history`), persisted state (:mod:`broker.state`) and stats
(:mod:`broker.stats`, :mod:`broker.snapshot`). :mod:`broker.core` is the message-driven state machine over
those parts (its work-moving handlers in :mod:`broker.flow`); :mod:`broker.server` is the zmq event loop
around it; :mod:`broker.main` the entry point.
The broker never imports torch: tensor frames pass through as received ``zmq.Frame`` objects.
"""
