"""``python -m broker``: the same as ``loraflow broker``."""

import sys

from broker.main import main

sys.exit(main(sys.argv[1:]))
