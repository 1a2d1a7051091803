"""``python -m loraflow.learner`` (or ``torchrun ... -m loraflow.learner``): see :mod:`loraflow.learner.main`."""

import sys

from loraflow.learner.main import main

sys.exit(main(sys.argv[1:]))
