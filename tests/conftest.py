"""Shared fixtures: tiny random models built from a config (never downloaded).

The tests mirror ``marft/`` (``envs/``, ``sandbox/``, ``agents/``, ``algorithms/``, ``runner/``, ``models/``, ``cli/``),
with end-to-end and slow runs in ``integration/``; the helpers that are not tests (``team_oracle``, ``dist_worker``,
...) stay here. Test modules share helpers by module name (``from test_team import make_team``) whatever their
folder: every test folder is on ``sys.path``, put there before any test module is collected.
"""

import logging
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

DATA_DIR = Path(__file__).resolve().parents[2] / "shared" / "data"

TEST_FOLDERS = sorted(folder for folder in Path(__file__).resolve().parent.iterdir() if folder.is_dir() and any(folder.glob("test_*.py")))
"""The test folders under ``tests/``, each on ``sys.path`` (after ``tests/`` itself, which pytest puts first)."""
for _folder in TEST_FOLDERS:
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    """An untrained tiny Qwen2-style model and tokenizer, saved once per test session."""
    from marft.models.tiny import build_random_model

    return build_random_model(str(tmp_path_factory.mktemp("random_model")))


@pytest.fixture(autouse=True)
def _quiet_warnings():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield


@pytest.fixture
def clean_registry():
    """Environments a test registers are gone after it (the registry test lists every registered name)."""
    import marft.envs

    before = dict(marft.envs._REGISTRY)
    yield
    marft.envs._REGISTRY.clear()
    marft.envs._REGISTRY.update(before)


@pytest.fixture
def unwritable_dir(tmp_path):
    """A folder nothing can be written in, even by root: a read-only folder for a user, ``/sys/kernel`` for root
    (where ``os.access`` says yes and a write fails). Yields the folder; a run dir below it cannot be created."""
    if os.geteuid() == 0:
        folder = Path("/sys/kernel")
        if not folder.is_dir():
            pytest.skip("root, and no /sys/kernel to stand for an unwritable folder")
        yield folder
        return
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    yield folder
    folder.chmod(0o755)


@pytest.fixture
def one_thread():
    """One intra-op thread: much faster for the tiny models on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _register_dense_relay_sum():
    """``dense_relay_sum``: ``relay_sum`` whose reward is a checksum of the answerer's reply in [0, 1] (two replies
    rarely tie); never solved. Random models score 0 on ``relay_sum`` (a batch of equal rewards trains only the critic), so tests
    that need policy updates on a random model use this env."""
    import marft.envs
    from marft.envs import StepOutcome
    from marft.envs.relay_sum.env import RelaySumEnv

    class DenseRelaySum(RelaySumEnv):
        def evaluate(self, state, actions):
            reward = (sum(map(ord, actions[self.answer_index])) % 97) / 96
            return StepOutcome(rewards=(reward,) * self.n_agents, solved=False, feedback="Again.", info={"correct": False})

    marft.envs.register("dense_relay_sum", DenseRelaySum)


_register_dense_relay_sum()


def _register_dense_route():
    """``dense_route``: ``route`` whose reward is a checksum of the team's latest answer in [0, 1]; never solved
    (a random model never answers right, and equal rewards would train only the critic)."""
    import marft.envs
    from marft.envs import StepOutcome
    from marft.envs.route.env import RouteEnv

    class DenseRoute(RouteEnv):
        def evaluate(self, state, actions):
            answers = [actions[n] for n, spec in enumerate(self.profile) if spec.with_answer]
            reward = (sum(map(ord, answers[-1])) % 97) / 96
            return StepOutcome(rewards=(reward,) * self.n_agents, solved=False, feedback="Again.", info={"correct": False})

    marft.envs.register("dense_route", DenseRoute)


_register_dense_route()


@pytest.fixture
def scripted_orchestrator(monkeypatch):
    """An orchestrator whose every reply is read as a call or ``<done/>`` by its checksum (a random model never
    writes the tags): 0 → the first specialist, 1 → the second, 2 → done. Deterministic in the reply, so
    different envs call different specialists at one moment and resumed runs replay alike."""
    from marft.envs.workflows import OrchestratedWorkflow

    def parse(self, reply):
        pick = sum(map(ord, reply)) % 3
        specialists = sorted(self.specialists.values())
        return -1 if pick == 2 else specialists[pick % len(specialists)]

    monkeypatch.setattr(OrchestratedWorkflow, "parse", parse)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: an integration test that trains, spawns processes or builds a model (the fast subset: -m 'not slow')"
    )


PREBUILT_MODELS = ("marft-tiny", "marft-tiny-instruct")
"""The embedded models the suite trains on, built in the background while the first tests run (see
:func:`pytest_collection_finish`)."""


def pytest_collection_finish(session):
    """Build the embedded models the suite needs in a background process at the lowest CPU priority (``nice 19``), so
    their single-threaded builds use the core the many one-thread tests leave
    idle. A test that needs a model before it is built waits on the build's lock, as any second process does; the
    build is pinned (one thread, deterministic kernels), so its weights do not depend on what else runs. Nothing is
    started when the models are cached, when no test was collected or none will run (``--collect-only``), or with
    ``MARFT_TEST_PREBUILD=0``."""
    import subprocess

    from marft.models.loading import EMBEDDED_RECIPES
    from marft.models.tiny import cached_model_dir

    missing = [name for name in PREBUILT_MODELS if not cached_model_dir(EMBEDDED_RECIPES[name]).is_dir()]
    if not missing or not session.items or session.config.option.collectonly or os.environ.get("MARFT_TEST_PREBUILD", "1") == "0":
        return
    code = ("from marft.models.loading import resolve_model_path\n"
            f"for name in {missing!r}:\n    resolve_model_path(name)\n")
    session.config._marft_prebuild = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)


def pytest_sessionfinish(session, exitstatus):
    """Stop a background build still running: an interrupt first, which removes its half-built folder as a failed
    build does, then a kill."""
    import signal
    import subprocess

    build = getattr(session.config, "_marft_prebuild", None)
    if build is None or build.poll() is not None:
        return
    os.killpg(build.pid, signal.SIGINT)
    try:
        build.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(build.pid, signal.SIGKILL)
        build.wait()
