import sys

from loraflow.rollout_worker.main import main

if __name__ == "__main__":
    sys.exit(main())
