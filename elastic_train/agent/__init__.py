"""The agent process: ``elastic-train run``, one per node, torch.distributed.elastic's agent
with our additions. It outlives its workers.

``launch`` parses the command line (``launch_options``: torchrun's options; ``environment``:
torchrun's ``PET_*`` defaults and what the agent sets for its workers) and runs torch's
launcher; ``worker_start`` starts the workers (a forkserver that imported torch once);
``store_binding`` binds the agents' store where configured; ``live_agent`` re-forms the
world in place when a worker or a node is lost (torch's hooks; the coordination it runs is
``elastic_train.live``'s; its parts: ``live_node``, ``job_store``, ``worker_messages``,
``silent_peers``, ``worker_processes``, ``store_watch``, ``wake``, ``round_ranks``);
``failure_detector`` notices a silent peer node; ``exit_watch`` notices a worker's death at
once; ``logs`` shapes torch's agent log lines; ``snapshot_holder`` keeps the newest
checkpoint in memory for the memory tier (its peers: ``holder_directory``).

Imports from ``elastic_train.worker`` only the entrypoints it launches (``train``,
``script_worker``); tests/unit/test_package_rules.py holds it to that.
"""
