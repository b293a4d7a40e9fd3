"""The worker process: one per rank, started by an agent (ours or torchrun's).

Two loops share one protocol: ``trainer`` (the built-in job, entrypoint ``train``) and
``session`` (``ElasticSession``, for a hand-written loop); ``runtime`` is that protocol
(votes, checkpoints, stops, live recovery), and knows neither loop. Beside it:
``distributed`` (the process group, its collectives, their abort, DDP's renewal),
``live_world`` (the worker's side of live recovery), ``sampler`` and ``batching`` (exactly-
once data at any world size), ``preemption``, ``save_failure`` and ``watchdog`` (how a
step ends early), ``seeding`` and ``determinism``, ``env`` (what torchrun tells a worker),
``script_worker`` (a user's script run by our agent), ``memory_tier`` (the agent's
snapshot holder, for the checkpoint manager).

Imports nothing from ``elastic_train.agent`` (tests/unit/test_package_rules.py).
"""
