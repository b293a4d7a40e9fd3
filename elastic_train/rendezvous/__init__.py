"""Everything about rendezvous: its configuration for every backend, and the etcd v3 backend
for torch's elastic agent (``--rdzv-backend etcd-v3``, in etcd_v3/).

For every backend (free of torch imports where the launcher uses them before it imports
torch): ``config`` holds the ``--rdzv-*`` defaults per backend and parses and checks
``--rdzv-conf``; ``heartbeat`` the heartbeat defaults and checks; ``failures`` the lines for
rendezvous errors torch leaves unexplained; ``preflight`` checks a rendezvous service before
a launch; ``timing`` hands how long a rendezvous took to the next workers; ``forget`` removes
nodes that live recovery found lost from torch's dynamic rendezvous; ``torch_seams`` holds
the private names of torch's dynamic handler that ``forget`` and etcd_v3's state-key design
use; ``plugin`` is the ``torchrun.handlers`` entry point of ``etcd-v3``.

etcd_v3/ (see its ``__init__``): ``create.create_handler`` picks one of two designs,
``leases`` (the default) and ``state-key``. Importing this package registers nothing (torch
does, through the entry point).
"""
