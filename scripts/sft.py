"""Supervised warm start of an agent team (SFT before RL): ``python scripts/sft.py --env_name ... [--sft_data FILE]``.

Takes every training flag of ``train_math.py`` plus the warm-start flags (``--help``), trains each role's
adapter on its own turns, and saves ``<run dir>/checkpoints/steps_0``; start RL from it with ``--load_path``.
"""

import sys

from marft.cli.sft import main

if __name__ == "__main__":
    sys.exit(main())
