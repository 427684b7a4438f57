"""``scripts/train_math.py`` under ``torch.profiler``: the ops that take the time of training iterations.

Profiling starts with the rollout of iteration ``--profile_from`` (0-based; the first iterations warm up) and
ends with the run (the final evaluation and save are in it, a small share); the table of the top ops by self CPU
time is printed at the end. Every other flag is ``train_math.py``'s::

    python scripts/profile_training.py --profile_from 2 --num_env_steps 48 ...
"""

import argparse
import sys

from torch.profiler import ProfilerActivity, profile

from marft.cli.train import main
from marft.runner.shared.collector import RolloutCollector


def profiled_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--profile_from", type=int, default=2, help="iteration (0-based) whose rollout starts the profile")
    parser.add_argument("--profile_rows", type=int, default=12, help="ops in the printed table")
    args, rest = parser.parse_known_args(argv)
    profiler = profile(activities=[ProfilerActivity.CPU])
    collect, started = RolloutCollector.collect, []

    def collect_and_start(self, iteration: int = 0):
        if iteration == args.profile_from and not started:
            profiler.start()
            started.append(iteration)
        return collect(self, iteration)

    RolloutCollector.collect = collect_and_start
    try:
        return main(rest)
    finally:
        RolloutCollector.collect = collect
        if started:  # the run reached that iteration
            profiler.stop()
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))


if __name__ == "__main__":
    sys.exit(profiled_main(sys.argv[1:]))
