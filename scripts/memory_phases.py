"""Peak resident memory per phase of a training iteration: which phase grows with the team size, and how much
of it is live tensors rather than memory the allocator keeps after torch frees it.

    python scripts/memory_phases.py --model random --hidden_size 768 --num_layers 12 --n_agents 4 --max_chunk_tokens 3200
    MALLOC_MMAP_THRESHOLD_=131072 python scripts/memory_phases.py ...   # glibc returning large blocks at once
    python scripts/memory_phases.py --n_agents 4 --versus_agents 2 ...    # the extra cost of a larger team

Takes ``scripts/benchmark.py``'s flags (its ``iteration`` setup) and runs ``--repeats + 1`` iterations. A thread
reads the process's resident memory every millisecond and keeps the highest value per phase: ``generate`` (replies
sampled), ``critic_values`` (the turns' values: in the rollout, or under ``--values_in_update`` right after it, with their
gradient, kept until the first critic step), ``collect`` (the rest of the rollout), ``advantages``,
``update_critic``, ``update_policy``. ``live_tensor_mib`` counts the CPU tensors reachable after the last rollout,
``resident_mib`` the resident memory then. With ``--versus_agents N`` the same command with ``--n_agents N`` runs
first in a process of its own, and ``extra_model_copies`` is the difference of the two peaks in copies of the other
team's model (``params_mib``: the base weights with that team's adapters and critic). Prints ONE line of JSON (MiB).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark  # noqa: E402 - the benchmark's flags and runner set-up

PAGE_MIB = os.sysconf("SC_PAGE_SIZE") / 2**20


def resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_MIB


def live_tensor_mib() -> float:
    """CPU tensor storages reachable from Python, each counted once."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / 2**20


class PhasePeaks:
    """The highest resident memory seen while each named phase ran (sampled by a daemon thread)."""

    def __init__(self, interval_s: float = 0.001):
        self.phase, self.peaks, self.interval_s = "setup", {}, interval_s
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            now = resident_mib()
            if now > self.peaks.get(self.phase, 0.0):
                self.peaks[self.phase] = now
            time.sleep(self.interval_s)

    @contextmanager
    def phase_of(self, name: str):
        outer, self.phase = self.phase, name
        try:
            yield
        finally:
            self.phase = outer

    def wrap(self, obj, method: str, name: str) -> None:
        """Count the time inside ``obj.method`` as phase ``name``."""
        inner = getattr(obj, method)

        def timed(*args, **kwargs):
            with self.phase_of(name):
                return inner(*args, **kwargs)

        setattr(obj, method, timed)


def versus(argv: list[str], n_agents: int) -> dict:
    """This script's result for the same flags with ``--n_agents n_agents``, from a process of its own (peak
    resident memory is per process)."""
    command = [sys.executable, __file__, *argv, "--n_agents", str(n_agents)]  # the last --n_agents wins
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the --n_agents {n_agents} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--versus_agents", type=int, default=None)
    known, argv = own.parse_known_args(argv)
    if {"-h", "--help"} & set(argv):
        print(__doc__ + "\n  --versus_agents N     run the same command with --n_agents N first; report the difference\n\n"
              "scripts/benchmark.py's flags (its iteration set-up):\n")
        benchmark.parse_args(["iteration", "--help"])
    if known.versus_agents is not None and known.versus_agents < 1:
        raise SystemExit(f"--versus_agents must be >= 1, got {known.versus_agents}")
    other = versus(argv, known.versus_agents) if known.versus_agents is not None else None
    args = benchmark.parse_args(["iteration", *argv])
    peaks = PhasePeaks()
    runner, _, _ = benchmark.build_runner(args)
    team, trainer = runner.team, runner.trainer
    peaks.wrap(team.backend, "sample", "generate")
    peaks.wrap(team.critic, "value_batches", "critic_values")
    if trainer.values_in_update:  # the turns' values come from the update's first critic forward, after the rollout
        peaks.wrap(trainer, "value_turns", "critic_values")
    peaks.wrap(trainer, "update_critic", "update_critic")
    peaks.wrap(trainer, "update_policy", "update_policy")
    for i in range(args.repeats + 1):
        with peaks.phase_of("collect"):
            buffer, _ = runner.collector.collect(i)
        after_rollout = {"live_tensor_mib": live_tensor_mib(), "resident_mib": resident_mib()}
        with peaks.phase_of("advantages"):
            trainer.compute_advantages(buffer)
        with peaks.phase_of("update"):
            trainer.update(buffer, i)
    time.sleep(10 * peaks.interval_s)
    result = {
        "bench": "memory_phases",
        **benchmark.setup_fields(args, team),
        "max_chunk_tokens": args.max_chunk_tokens,
        "max_chunk_mib": args.max_chunk_mib,
        "chunk_tokens": trainer.chunk_tokens,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "params_mib": sum(p.numel() * p.element_size() for p in team.model.parameters()) / 2**20,
        "peak_mib": round(max(peaks.peaks.values()), 1),
        "phase_peak_mib": {name: round(value, 1) for name, value in peaks.peaks.items()},
        **after_rollout,
    }
    if other is not None:
        result["versus"] = {key: other[key] for key in ("n_agents", "model", "n_envs", "max_chunk_tokens", "chunk_tokens", "params_mib", "peak_mib", "phase_peak_mib")}
        result["extra_model_copies"] = round((result["peak_mib"] - other["peak_mib"]) / other["params_mib"], 3)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
