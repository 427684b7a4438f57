"""``scripts/train_math.py`` under ``torch.profiler``: the ops that take the time of training iterations.

Profiling starts with the rollout of iteration ``--profile_from`` (0-based; the first iterations warm up) and
ends with the last iteration (the final evaluation and save are not in it); the table of the top ops by self CPU
time is printed at the end. Every other flag is ``train_math.py``'s::

    python scripts/profile_training.py --profile_from 2 --num_env_steps 48 ...

``--flops`` adds the compute floor: the matrix products' FLOPs per iteration (as the profiler counts them:
``mm``, ``addmm``, ``bmm``; attention is not counted), the seconds those ops took, and the seconds the same FLOPs
would take at this machine's rate for one large product (``--peak_size`` square, float32), printed as one line of
JSON at the end. A workload whose iteration takes little more than that floor is bound by its arithmetic, not by
per-op overhead; the profiler's own overhead makes its seconds an upper bound.
"""

import argparse
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from marft.cli.train import main
from marft.runner.shared.collector import RolloutCollector
from marft.runner.shared.runner import Runner

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
"""The profiler's matrix-product ops whose FLOPs it counts."""


def peak_gemm_gflops(size: int, repeats: int = 5) -> float:
    """GFLOP/s of one ``size`` × ``size`` float32 product on this machine, the best of ``repeats``."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def compute_floor(events, iterations: int, peak_size: int) -> dict:
    """Per iteration: the matrix products' GFLOP, their profiled seconds, and the seconds at the peak rate."""
    gemm = [e for e in events if e.key in GEMM_OPS]
    gflop = sum(e.flops for e in gemm) / 1e9 / iterations
    peak = peak_gemm_gflops(peak_size)
    return {"iterations": iterations, "gemm_gflop_per_iteration": round(gflop, 2),
            "gemm_profiled_s_per_iteration": round(sum(e.self_cpu_time_total for e in gemm) / 1e6 / iterations, 4),
            "peak_gemm_gflops": round(peak, 1), "floor_s_per_iteration": round(gflop / peak, 4),
            "torch_threads": torch.get_num_threads()}


def profiled_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--profile_from", type=int, default=2, help="iteration (0-based) whose rollout starts the profile")
    parser.add_argument("--profile_rows", type=int, default=12, help="ops in the printed table")
    parser.add_argument("--flops", action="store_true", help="also print the compute floor as JSON (see the module's docstring)")
    parser.add_argument("--peak_size", type=int, default=2048, help="--flops: the side of the square product timed for the peak rate")
    args, rest = parser.parse_known_args(argv)
    profiler = profile(activities=[ProfilerActivity.CPU], with_flops=args.flops)
    collect, finish = RolloutCollector.collect, Runner._finish
    state = {"running": False, "stopped": False, "iterations": 0}  # the profiler's, and the iterations it saw

    def collect_and_start(self, iteration: int = 0):
        if iteration == args.profile_from and not state["running"] and not state["stopped"]:
            profiler.start()
            state["running"] = True
        state["iterations"] += state["running"]
        return collect(self, iteration)

    def stop(self=None, *a, **k):
        if state["running"]:
            profiler.stop()
            state["running"], state["stopped"] = False, True
        return finish(self, *a, **k) if self is not None else None

    RolloutCollector.collect, Runner._finish = collect_and_start, stop
    try:
        return main(rest)
    finally:
        RolloutCollector.collect, Runner._finish = collect, finish
        stop()
        if state["stopped"]:  # the run reached that iteration
            events = profiler.key_averages()
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))
            if args.flops:
                print(json.dumps(compute_floor(events, state["iterations"], args.peak_size)))

if __name__ == "__main__":
    sys.exit(profiled_main(sys.argv[1:]))
