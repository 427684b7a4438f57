"""Train an LLM agent team on math problems with multi-agent PPO (MARFT).

Run ``python scripts/train_math.py --help`` for every flag.
"""

import sys

from marft.cli.train import run_main

if __name__ == "__main__":
    sys.exit(run_main())  # stop signals ignored after training: a late SIGTERM must not kill the exit
