"""``python -m elastic_train`` is the ``elastic-train`` command."""

import sys

from elastic_train.cli import main

sys.exit(main())
