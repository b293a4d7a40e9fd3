"""Rendezvous on etcd's v3 API for torch's elastic agent (``--rdzv-backend etcd-v3``).

``client`` is the only module that talks to etcd; ``backend`` holds torch's rendezvous
state in one key, fenced by its revision; ``store`` is the c10d store the agents share;
``plugin`` builds torch's ``DynamicRendezvousHandler`` from them and is the
``torchrun.handlers`` entry point; ``preflight`` checks a rendezvous service before a
launch. Importing this package registers nothing (torch does, through the entry point).
"""
