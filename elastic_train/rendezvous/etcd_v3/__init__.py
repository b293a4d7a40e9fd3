"""``--rdzv-backend etcd-v3``: torch's elastic rendezvous on etcd's v3 API.

``create.create_handler`` (torchrun's creator, through rendezvous/plugin.py) parses the
options (``options``) and picks one of two designs:

- ``design=leases`` (the default), designed for etcd: ``leases`` (one key per node,
  watches, one transaction to close a round), ``rounds`` (a round's rules apart from etcd),
  ``node_lease`` (a node's liveness: its own lease, renewed by a thread), ``outage`` (a job
  trains on while etcd is down);
- ``design=state-key``: torch's ``DynamicRendezvousHandler`` (``state_key``) on
  ``state_backend`` (the whole rendezvous state in one key, fenced by its revision) and
  ``shared_lease`` (one lease for that state and the store's keys).

Both serve the agents a c10d store on etcd (``store``). What they need of etcd is the
``KV`` contract (``kv``); ``client`` is the only module that talks to etcd (over its JSON
gateway: ``gateway`` for the wire format, ``watch`` for a watch stream), and the tests'
in-memory KV stands in for it.
"""
