"""Watch a trained team (or the base model) answer one problem: the conversation turn by turn, each turn with
its role. ``marft play`` (:mod:`marft.cli.play`) is this module from the command line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from marft.config import TrainConfig
from marft.envs.one_problem import OneProblemEnv
from marft.envs.workflows import workflow_for
from marft.runner.shared.turns import play_team_step
from marft.trained.evaluate import load_team, team_source


def play(problem: str, load_path: str | Path | None = None, config: TrainConfig | None = None, seed: int = 0,
         show: Callable[[str, str], None] | None = None, base_model: bool = False) -> list[list[tuple[str, str]]]:
    """The team of the checkpoint at ``load_path`` (``base_model``: with fresh adapters; no checkpoint: ``config``'s
    base model) plays
    ``problem``: its workflow, its prompts, sampling as in training (``seed``). Each turn is passed to
    ``show(role, text)`` as it is spoken (the host's handover lines of an orchestrated team included); returns
    the turns of every team step (``--horizon`` steps; the problem is not graded, so nothing ends it early).

    Raises:
        ValueError: an empty problem, or neither a checkpoint nor a config.
    """

    config, checkpoint = team_source(load_path, config)
    if not problem.strip():
        raise ValueError("the problem is empty: give the team a question")
    team, profile, _ = load_team(config, None if base_model else checkpoint)
    env = OneProblemEnv(problem, profile, horizon=config.env.horizon)
    env.set_workflow(workflow_for(profile, config.env.workflow, config.env.max_turns))
    torch.manual_seed(seed)
    obs, info = env.reset(seed=seed)
    private, steps, done = info["private_observations"], [], False
    with torch.no_grad(), team.headers.frozen():
        while not done:
            play_team_step(team, [env], [obs], [private])
            turns = env.spoken_turns()
            for role, text in turns:
                if show is not None:
                    show(role, text)
            steps.append(turns)
            obs, _, terminated, truncated, info = env.step(env.turn_actions())
            private, done = info["private_observations"], terminated or truncated
    return steps
