"""``python -m elastic_train`` is the ``elastic-train`` command."""

from elastic_train.cli import console

console()
