"""``python -m learner`` (or ``torchrun ... -m learner``): see :mod:`learner.main`."""

import sys

from learner.main import main

sys.exit(main(sys.argv[1:]))
