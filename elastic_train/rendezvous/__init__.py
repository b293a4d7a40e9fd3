"""Everything about rendezvous: its configuration, and the etcd v3 backend for torch's elastic
agent (``--rdzv-backend etcd-v3``).

Configuration (free of torch imports, used by the launcher before it imports torch):
``config`` holds the ``--rdzv-*`` defaults per backend and parses and checks ``--rdzv-conf``;
``heartbeat`` the heartbeat defaults and checks; ``failures`` the lines for rendezvous
errors torch leaves unexplained. ``options`` parses and checks the ``etcd-v3`` backend's
options; ``preflight`` checks a rendezvous service before a launch.

The etcd-v3 backend: ``client`` is the only module that talks to etcd; ``backend`` holds
torch's rendezvous state in one key, fenced by its revision; ``store`` is the c10d store
the agents share; ``handler`` builds torch's ``DynamicRendezvousHandler`` from them, and
``plugin`` is its ``torchrun.handlers`` entry point. Importing this package registers
nothing (torch does, through the entry point).
"""
