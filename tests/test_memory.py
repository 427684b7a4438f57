"""Peak host memory of the update does not grow with the number of agents (issue 30, Memory).

glibc keeps the activations one adapter's update frees in its heap, so each later phase (the next agent, the
critic) grew the process further: with one iteration of a 25M random model, peak RSS went 1250 -> 2022 MiB from
2 to 4 agents. The trainer now hands the freed pages back after each phase (``marft.memory``).
"""

import subprocess
import sys
import textwrap

import pytest
import torch
from test_team import fill_buffer, make_team

from marft.algorithms import trainer_class
from marft.config import AlgoConfig
from marft.memory import release_freed_host_memory

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_memory_goes_back_to_the_os():
    """In a fresh process: 1 MiB tensors (under glibc's raised mmap threshold, so they live in the heap) are freed,
    all but the last; the freed ~300 MiB stay in the process until the release."""
    code = textwrap.dedent("""
        import torch
        from marft.memory import release_freed_host_memory
        def rss():
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
        big = torch.ones(32 * 2**20 // 4); del big  # glibc raises its mmap threshold to 32 MiB
        blocks = [torch.ones(2**18) for _ in range(300)]  # 300 x 1 MiB in the heap
        keep = blocks[-1]
        del blocks
        before = rss()
        assert release_freed_host_memory()
        print(before - rss())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) > 200, done.stdout


@pytest.mark.parametrize("algorithm", ["APPO", "GRPO"])
def test_the_update_releases_memory_after_every_phase(random_model_dir, algorithm, monkeypatch):
    import marft.algorithms.appo_trainer as appo

    calls = []
    monkeypatch.setattr(appo, "release_freed_host_memory", lambda: calls.append(1) or True)
    torch.manual_seed(0)
    team = make_team(random_model_dir)
    trainer = trainer_class(algorithm)(team, AlgoConfig(algorithm_name=algorithm, ppo_epoch=1, update_on_constant_rewards=True), steps_per_iteration=8)
    buffer = fill_buffer(team, trainer=trainer)
    trainer.update(buffer, 0)
    assert len(calls) == team.n_agents + len(trainer.critic_optimizers)  # after each adapter's update
    assert release_freed_host_memory() is True
