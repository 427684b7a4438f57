"""Train an LLM agent team on math problems with multi-agent PPO (MARFT).

Run ``python scripts/train_math.py --help`` for every flag.
"""

import sys

from marft.cli.train import main
from marft.runner.shared.preemption import ignore_stop_signals

if __name__ == "__main__":
    code = main()
    ignore_stop_signals()  # trained and saved (or stopped and saved): a late SIGTERM must not kill the exit
    sys.exit(code)
