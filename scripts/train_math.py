"""Train an LLM agent team on math problems with multi-agent PPO (MARFT).

Run ``python scripts/train_math.py --help`` for every flag.
"""

import sys

from marft.launch import main

if __name__ == "__main__":
    sys.exit(main())
