"""marft: Multi-Agent Reinforcement Fine-Tuning of LLM agent teams.

The Python API, for scripts and notebooks::

    from marft import EnvConfig, RunnerConfig, TrainConfig, train

    config = TrainConfig(env=EnvConfig(env_name="relay_sum"),
                         runner=RunnerConfig(num_env_steps=640, n_rollout_threads=32, episode_length=1))
    summary = train(config)   # the same run as: bash scripts/train_math.sh --env_name relay_sum --num_env_steps 640 ...
    print(summary["accuracy_before"], "->", summary["accuracy_after"], summary["run_dir"])

:func:`train` validates the config (profile, model path, data, environment) before the model loads and
returns the run summary; the command line (``python -m marft.launch``, ``scripts/train_math.sh``) runs the same.
"""

from marft.config import AlgoConfig, EnvConfig, ModelConfig, RunnerConfig, TrainConfig

__all__ = ["AlgoConfig", "EnvConfig", "ModelConfig", "RunnerConfig", "TrainConfig", "evaluate", "export", "make", "play", "register", "train"]

_LAZY = {"make": "marft.envs", "register": "marft.envs", "train": "marft.launch", "evaluate": "marft.trained.evaluate",
         "export": "marft.trained.export", "play": "marft.trained.play"}
"""Names imported on first use, so ``import marft`` (and ``import marft.config``) load no torch."""


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'marft' has no attribute {name!r}")
