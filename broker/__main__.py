"""``python -m loraflow.broker``: the same as ``loraflow broker``."""

import sys

from loraflow.broker.main import main

sys.exit(main(sys.argv[1:]))
