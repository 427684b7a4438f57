"""Train an agent team on programming problems: ``scripts/train_math.py`` with ``--env_name code``.

    python scripts/train_code.py --dataset_path generated                       # the default
    python scripts/train_code.py --dataset_path data/deepcoder.jsonl --eval_dataset_path humaneval

Two things the general entry point does not do yet for non-math environments are bridged here,
until ``marft.train`` does them itself:

* ``--dataset_path`` / ``--eval_dataset_path`` reach ``CodeEnv`` (``build_env_factories`` passes
  only ``split``, ``profile`` and ``horizon`` to non-math envs);
* the training envs are a ``CodeVectorEnv``, which grades all envs' programs of a step in parallel.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import marft.envs.vector  # noqa: E402
import marft.train  # noqa: E402
from marft.envs.code.data import load_code_problems  # noqa: E402
from marft.envs.code.vector import CodeVectorEnv  # noqa: E402


def build_code_env_factories(config, profile):
    """``(make_train_env, make_eval_env)`` for ``CodeEnv`` on ``--dataset_path`` (train split) and
    ``--eval_dataset_path`` (default: the test split of ``--dataset_path``); data loaded once."""
    from marft.envs import make

    ec = config.env
    source = "generated" if ec.dataset_path == "arithmetic" else ec.dataset_path  # the math default means "not given"
    train_problems = load_code_problems(source, split="train").problems
    eval_problems = load_code_problems(ec.eval_dataset_path or source, split="test").problems
    kwargs = dict(profile=profile, horizon=ec.horizon)
    return (lambda: make("code", problems=train_problems, **kwargs)), (lambda: make("code", problems=eval_problems, **kwargs))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--env_name" or a.startswith("--env_name=") for a in argv):
        argv = ["--env_name", "code", *argv]
    marft.train.build_env_factories = build_code_env_factories
    marft.envs.vector.TextVectorEnv = CodeVectorEnv
    return marft.train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
