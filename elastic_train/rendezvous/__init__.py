"""Everything about rendezvous: its configuration, and the etcd v3 backend for torch's elastic
agent (``--rdzv-backend etcd-v3``).

Configuration (free of torch imports, used by the launcher before it imports torch):
``config`` holds the ``--rdzv-*`` defaults per backend and parses and checks ``--rdzv-conf``;
``heartbeat`` the heartbeat defaults and checks; ``options`` the ``etcd-v3`` backend's
options; ``failures`` the lines for rendezvous errors torch leaves unexplained;
``preflight`` checks a rendezvous service before a launch.

The etcd-v3 backend: ``client`` is the only module that talks to etcd; ``store`` is the c10d
store the agents share; ``plugin`` is the ``torchrun.handlers`` entry point, and
``handler.create_handler`` picks one of two designs:

- ``design=leases`` (the default), designed for etcd: ``lease_handler`` (one key per node,
  watches, one transaction to close a round), ``rounds`` (a round's rules apart from etcd),
  ``node_lease`` (a node's liveness: its own lease, renewed by a thread), ``outage`` (a job
  trains on while etcd is down);
- ``design=state-key``: torch's ``DynamicRendezvousHandler`` (``handler``) on ``backend``
  (the whole rendezvous state in one key, fenced by its revision) and ``lease`` (one lease
  for that state and the store's keys).

For every backend: ``timing`` hands how long a rendezvous took to the next workers;
``forget`` removes nodes that live recovery found lost from torch's dynamic rendezvous.
Importing this package registers nothing (torch does, through the entry point).
"""
