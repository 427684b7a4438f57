"""The allowed values of every choice flag: one table per flag, name → what it means.

A leaf: it imports nothing, so the config (:mod:`marft.config`), ``--help`` and validation read the names
without loading torch or any model code. The implementations live where they belong (the trainer classes in
``marft.algorithms``, the generation backends in ``marft.agents.generation`` …) and look their entries up by
these names; ``tests/test_architecture.py`` checks that every implementation table has exactly these keys.
"""

from __future__ import annotations

DTYPES: dict[str, str] = {
    "float32": "32-bit floats (the default; exact on CPU)",
    "bfloat16": "bfloat16 weights and activations (GPU)",
    "float16": "float16 weights and activations (GPU)",
}
"""``--dtype`` → the parameter dtype (the torch dtypes: :data:`marft.agents.dtypes.TORCH_DTYPES`)."""

GENERATION_BACKENDS: dict[str, str] = {
    "decode_loop": "marft's own sampling loop (the default; the same ids and log-probs as generate for a seed on CPU)",
    "generate": "transformers' model.generate (the reference and fallback)",
    "vllm": "one colocated vLLM engine, each agent's adapter served as a LoRA (needs vLLM installed)",
}
"""``--generation_backend`` → how replies are sampled (the classes: :data:`marft.agents.backends.BACKEND_CLASSES`)."""

ROLLOUT_CORRECTIONS: dict[str, str] = {
    "none": "no correction: the rollout's replies are taken as the trainer's policy sampled them",
    "truncate": "weight each reply (per token in token-level losses) by min(trainer/engine probability ratio, cap): truncated importance sampling",
    "mask": "drop replies whose trainer/engine probability ratio is above cap or below 1/cap",
}
"""``--rollout_correction`` → how the policy loss corrects for an inference engine sampling from a slightly
different distribution than the trainer scores (``--generation_backend vllm``; with the other backends the
two are the same and the weights are 1)."""

NORMALIZATION_MODES: dict[str, str] = {
    "sum": "a reply's log-prob is the plain sum of its token log-probs",
    "token": "the mean per token of the reply",
    "word": "the sum per word of the decoded reply",
}
"""``--normalization_mode`` → how a reply's log-prob is formed from its summed token log-probs
(the functions: :data:`marft.algorithms.losses.NORMALIZERS`)."""

WORKFLOWS = {
    "auto": "what the profile describes: a graph, an orchestrator, or the profile order",
    "sequential": "every agent once per team step, in profile order (a profile with a graph or an orchestrator is refused)",
    "graph": "a DAG of roles from the profile's 'graph'; nodes of one layer speak in parallel on the same history",
    "orchestrated": "an orchestrator agent (the profile's 'orchestrator') calls specialists with <call>Role</call> and ends with <done/>",
}
"""``--workflow`` → what it plays (the one table of workflows)."""

GAME_VIEWS = {
    "since_move": "the game's rules and the messages since the agent's previous move (the opponent's move, the board, "
                  "the legal moves)",
    "board": "the game's rules and its latest board and any messages after it (as TextArena's GameBoardObservationWrapper): "
             "one position is one prompt however it was reached; for games whose board TextArena marks as such",
}
"""``--game_view`` → what a TextArena game shows an agent (``marft.envs.textarena.env.TextArenaEnv``'s ``view``)."""

CREDIT_MODES = {
    "env": "the environment's per-agent rewards go into the agent chain as they are (the original MARFT): agent n's "
           "reward on its last turn of the step, the rewards of agents that did not speak on the step's last turn, so a "
           "reward flows back to every earlier turn and, with gamma = lambda = 1, the step's first turn returns the sum "
           "of all N agents' rewards (N x R for a team reward R) however many turns the step took",
    "equal": "every turn of a team step is credited with the team reward R (the mean of the agents' rewards), "
             "however many turns the step took",
    "step_discount": "a turn followed by j more layers of its step (one turn each, except a parallel graph layer) is "
                     "credited with R x credit_discount^j: later turns get more; the only mode where a turn's credit "
                     "depends on the turns taken after it (by design)",
    "per_step": "every turn is credited with its own agent's reward from the environment (StepOutcome.rewards), "
                "each of an agent's turns alike",
    "own_turns": "MARFT-A and MARFT-T self-play: each agent's turns form a chain of their own, a turn paid its agent's rewards until "
                 "that agent's next turn (the opponent's moves and the game's end included) and bootstrapping from the "
                 "agent's own next turn, never the opponent's; the collector plays rounds of whole episodes "
                 "(--episode_length a multiple of --horizon). With --critic_mode per_agent each seat has its own critic",
}
"""``--credit_assignment`` → how the environment's rewards become each turn's credit (the one table of modes).

The environment grades a team step once and gives each of the N agents a reward (``agent_rewards (T, E, N)``);
the team reward R is their mean. A step may take any number of turns (an orchestrator calling specialists,
an agent speaking twice, one that never speaks), so every mode is defined over turns without counting them:
with a critic, a turn's return within its step is its credit (``env``: the rewards still to come in the step);
with GRPO, an agent's step credit is the mean of its turns' credits (``env``: the team return)."""

CHAT_TEMPLATE_MODES = {
    "auto": "render each agent's prompt with the tokenizer's chat template when it has one, else the plain transcript",
    "none": "the plain transcript (role header, private observation, conversation, cue)",
}
"""``--chat_template`` → how prompts are written (the one table of modes)."""

CRITIC_MODES = {
    "shared": "one centralized critic for every agent",
    "per_agent": "one critic adapter and value head per agent",
}
"""``--critic_mode`` → what it builds (the one table of modes)."""

CRITIC_INITS = {
    "fresh": "the critic adapters as the checkpoint has them (after marft sft: untrained, so the critic starts from the base model's features)",
    "policy": "at the start of RL from a warm start, each critic adapter a copy of the policy adapter whose turns it values",
}
"""``--critic_init`` → what the critic starts from (the one table of modes)."""

KL_REFERENCES = {
    "base": "the base model, every adapter off",
    "initial": "each policy adapter as training started, kept frozen (a copy of the adapter)",
    "auto": "initial when training starts from --load_path (a checkpoint or warm start), base otherwise",
}
"""``--kl_reference`` → the KL penalty's reference policy (the one table of references)."""

LR_SCHEDULES = {
    "constant": "every update at --lr / --critic_lr",
    "linear": "from --lr / --critic_lr at the first iteration down linearly to 0 after the last (CleanRL's anneal_lr)",
}
"""``--lr_schedule`` → how the learning rates move over a run (the one table of schedules)."""

ON_COLLAPSE = {
    "warn": "log a warning naming the best checkpoint and train on",
    "stop": "save a checkpoint and end the run (its summary names the best checkpoint)",
    "rollback": "reload the best checkpoint's adapters, critic and optimizers, make them the KL reference, lower the learning rates by --rollback_lr_factor, and train on",
}
"""``--on_collapse`` → what a run does when its moving training accuracy falls well below its best (the one table)."""

KL_ESTIMATORS = {
    "k3": "exp(r) - r - 1 with r = log p_ref - log p as the loss: its gradient on the policy's own samples is that of KL(reference || policy), which pulls like supervised training on the reference's replies",
    "k2": "(log p - log p_ref)^2 / 2 as the loss: its gradient on the policy's own samples is that of KL(policy || reference), the KL of the regularised objective",
}
"""``--kl_estimator`` → the per-token KL term of the loss (the one table of estimators)."""

TRAINERS: dict[str, str] = {
    "APPO": "marft.algorithms.appo_trainer:APPOTrainer",
    "TPPO": "marft.algorithms.tppo_trainer:TPPOTrainer",
    "GRPO": "marft.algorithms.grpo_trainer:GRPOTrainer",
}
"""``--algorithm_name`` → trainer class. APPO: action-level MAPPO (MARFT-A); TPPO: token-level (MARFT-T);
GRPO: critic-free, group-relative."""

KL_COEF_DEFAULTS: dict[str, float] = {"APPO": 0.1, "TPPO": 0.1, "GRPO": 0.0125}
"""``--algorithm_name`` → the KL penalty's weight when ``--kl_coef`` is not given. GRPO's is an eighth of the
others': its group-relative advantages are zero on every reply of a group that all solved or all failed (most replies
once training has found the answer: ``charts/zero_advantage_share``), while MARFT-A
and MARFT-T standardise their advantages over the whole batch, so the same weight pulls several times harder
against GRPO's policy gradient than against theirs (docs/algorithms.md)."""
