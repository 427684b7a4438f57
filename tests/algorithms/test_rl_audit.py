"""Each finding of the RL audit (issue 11), pinned by a test that failed before its fix.

1 top-k keeps ratios and KL finite · 2 the checkpoint's generation_config.json does not leak into sampling ·
3 a shared adapter gets one update per iteration · 4 the gradient does not depend on --gradient_cp_steps ·
5 LoRA dropout only in the update · 6 adapter parameters by exact name · 7 truncation bootstraps (runner level;
the GAE and vector-env parts are in test_advantages / test_token_advantages / test_envs) · 8 the agent schedule
counts env steps as the original MARFT · 9 abbreviated and ``=`` flags survive a resume · 11 one registry per choice.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_team import HISTORIES, fill_buffer, make_team

from marft.agents.adapters import adapter_of
from marft.agents.team import AgentTeam
from marft.algorithms import TRAINERS, trainer_class
from marft.choices import NORMALIZATION_MODES
from marft.config import CHOICES, AlgoConfig, ModelConfig, TrainConfig, build_parser, parse_config
from marft.envs.profile import AgentSpec
from marft.models.loading import load_base_model

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.usefixtures("one_thread")


def perturb_adapters(team, std=0.3, names=None):
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if adapter_of(name) is not None and (names is None or adapter_of(name) in names):
                p.normal_(std=std)


# ---------------------------------------------------------------------- 1. top-k
@pytest.mark.parametrize("mode", sorted(NORMALIZATION_MODES))
def test_top_k_keeps_ratio_and_kl_finite_when_sampled_tokens_leave_the_top_k(random_model_dir, mode):
    """Replies sampled with --top_k 3, then the policy moves so that many sampled tokens fall out of its top 3:
    the ratio stays positive and finite, the approximate KL stays small and finite (not ~1e8), a positive
    advantage still has a gradient, and the out-of-top-k tokens are counted."""
    torch.manual_seed(0)
    team = make_team(random_model_dir, top_k=3)
    trainer = trainer_class("APPO")(team, AlgoConfig(normalization_mode=mode, kl_coef=0.0), steps_per_iteration=8)
    buffer = fill_buffer(team, trainer=trainer)
    perturb_adapters(team, std=0.5, names={"reasoner"})
    samples = buffer.agent_samples(0)
    mb = samples.replace(advantages=torch.ones(len(samples.prompt_ids)))
    team.set_active("reasoner", trainable=True)
    loss, _, stats = trainer.policy_loss("reasoner", mb)
    loss.backward()
    assert trainer.counters["out_of_topk_tokens"] > 0
    assert torch.isfinite(loss) and 0 < stats["ratio"] < 1e3 and 0 <= stats["approx_kl"] < 50
    grad = sum(float(p.grad.abs().sum()) for p in team.adapter_parameters("reasoner") if p.grad is not None)
    assert grad > 0


# ---------------------------------------------------------------------- 2. generation_config.json
HOSTILE_GENERATION_CONFIG = {
    "do_sample": True, "top_k": 1, "top_p": 0.1, "min_p": 0.9, "typical_p": 0.2, "repetition_penalty": 5.0,
    "no_repeat_ngram_size": 1, "suppress_tokens": list(range(3, 300)), "begin_suppress_tokens": list(range(300, 400)),
    "bad_words_ids": [[5], [6], [7]], "min_new_tokens": 6, "temperature": 0.05, "max_new_tokens": 2, "epsilon_cutoff": 0.01,
}
"""What real checkpoints (and worse) put in generation_config.json: every field would change what is sampled."""


def test_the_checkpoints_generation_config_does_not_change_sampling(random_model_dir, tmp_path):
    """The same weights with and without a hostile generation_config.json sample exactly the same ids with the
    same recorded log-probs: only the team's own temperature / top-k shape sampling."""
    hostile = tmp_path / "hostile"
    shutil.copytree(random_model_dir, hostile)
    (hostile / "generation_config.json").write_text(json.dumps(HOSTILE_GENERATION_CONFIG))
    outs = []
    for folder in (random_model_dir, str(hostile)):
        team = make_team(folder, temperature=0.9, top_k=50)
        torch.manual_seed(0)
        perturb_adapters(team)
        torch.manual_seed(1)
        outs.append(team.act(0, HISTORIES, [[]] * len(HISTORIES)))
    clean, polluted = outs
    assert torch.equal(clean.response_ids, polluted.response_ids) and torch.equal(clean.response_mask, polluted.response_mask)
    torch.testing.assert_close(clean.logprobs, polluted.logprobs, atol=1e-6, rtol=0)
    assert len(set(clean.response_ids[clean.response_mask.bool()].tolist())) > 5  # really sampled, not greedy


# ---------------------------------------------------------------------- 3. shared adapter
def test_a_shared_adapter_gets_one_update_per_iteration_on_every_agents_turns(random_model_dir):
    """--shared_lora with --agent_iteration_interval 0: ONE optimizer step per minibatch and epoch on the shared
    adapter, over the turns of all agents (not one PPO run per agent on the same adapter)."""
    torch.manual_seed(0)
    team = make_team(random_model_dir, shared_lora=True)
    trainer = trainer_class("APPO")(team, AlgoConfig(ppo_epoch=2, num_mini_batch=1), steps_per_iteration=8)
    buffer = fill_buffer(team, trainer=trainer)
    calls = []
    original = trainer.update_policy
    trainer.update_policy = lambda adapter, samples: calls.append((adapter, len(samples.prompt_ids))) or original(adapter, samples)
    trainer.update(buffer, 0)
    assert calls == [("shared", 2 * 4 * team.n_agents)]  # T=2 steps x E=4 envs x both agents, one update
    assert torch.equal(buffer.agent_samples([0, 1]).response_ids[:8], buffer.agent_samples(0).response_ids)


# ---------------------------------------------------------------------- 4. gradient accumulation
def one_step_gradients(trainer, update, *args) -> list[torch.Tensor]:
    """The accumulated gradient of the first optimizer step of ``update(*args)`` (the step itself is skipped)."""
    grads = []

    def record(optimizer, params, loss_ok, name):
        if not grads:
            grads.extend(torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params)
        optimizer.zero_grad(set_to_none=True)
        return 0.0

    trainer._step = record
    update(*args)
    return grads


@pytest.mark.parametrize("mode", sorted(NORMALIZATION_MODES))
@pytest.mark.parametrize("algorithm", sorted(TRAINERS))
def test_gradient_does_not_depend_on_gradient_cp_steps(random_model_dir, algorithm, mode):
    """--gradient_cp_steps is a memory setting: the policy's and the critic's gradients are the same (allclose)
    with 1 and 4 chunks, for ragged replies (chunks of different token counts)."""
    torch.manual_seed(0)
    team = make_team(random_model_dir)
    perturb_adapters(team, std=0.1)
    results = {}
    for cp in (1, 4):
        trainer = trainer_class(algorithm)(team, AlgoConfig(algorithm_name=algorithm, group_size=4, normalization_mode=mode, ppo_epoch=1, gradient_cp_steps=cp), steps_per_iteration=8)
        if cp == 1:
            torch.manual_seed(0)
            buffer = fill_buffer(team, trainer=trainer)
            lengths = torch.tensor([1, 6, 2, 5, 3, 6, 1, 4])  # (T·E,) ragged replies of agent 0, then the same for agent 1
            ragged = (torch.arange(buffer.response_mask.shape[-1]) < lengths.view(2, 4, 1, 1)).long()  # (T, E, 1, L)
            buffer.response_mask = buffer.response_mask * ragged
            trainer.compute_advantages(buffer)
        samples = buffer.agent_samples(0, trainer.token_level)
        results[cp] = [one_step_gradients(trainer, trainer.update_policy, "reasoner", samples)]
        if trainer.uses_critic:  # GRPO has none
            results[cp].append(one_step_gradients(trainer, trainer.update_critic, buffer.critic_samples(trainer.token_level)))
        team.set_active(None)
    for ones, fours in zip(results[1], results[4]):
        assert len(ones) == len(fours) > 0 and any(g.abs().sum() > 0 for g in ones)
        for a, b in zip(ones, fours):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------------- 5. LoRA dropout
def test_lora_dropout_is_off_in_rollouts_and_scoring_and_on_in_the_update(random_model_dir):
    torch.manual_seed(0)
    team = make_team(random_model_dir, lora_dropout=0.5)
    perturb_adapters(team)
    assert team.bank.lora_dropouts and not any(m.training for m in team.model.modules())
    torch.manual_seed(0)
    out = team.act(0, HISTORIES, [[]] * len(HISTORIES))
    with torch.no_grad():
        args = ("reasoner", out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
        first, second = team.response_logprobs(*args).logprobs, team.response_logprobs(*args).logprobs
        assert torch.equal(first, second)  # the same reply scores the same twice
        torch.testing.assert_close(out.logprobs, first, atol=1e-5, rtol=0)  # and as it was sampled
        with team.bank.lora_dropout_active():
            assert not torch.equal(team.response_logprobs(*args).logprobs, team.response_logprobs(*args).logprobs)
        assert not any(m.training for m in team.model.modules())


# ---------------------------------------------------------------------- 6. adapter parameters by name
def test_roles_named_like_model_modules_select_only_their_own_adapter(random_model_dir):
    config = ModelConfig(model_name_or_path=random_model_dir, n_agents=4, max_new_tokens=6, context_window=128)
    model, tokenizer = load_base_model(config)
    profile = [AgentSpec(role, f"You are {role}.", i == 3) for i, role in enumerate(["Model", "MLP", "Layers", "1"])]
    team = AgentTeam(model, tokenizer, profile, config)
    assert team.agent_adapters == ["model", "mlp", "layers", "1"]
    every_lora = {n for n, _ in team.model.named_parameters() if "lora_" in n}
    chosen = {}
    for adapter in team.agent_adapters + ["critic"]:
        params = {id(p) for p in team.adapter_parameters(adapter)}
        chosen[adapter] = params
        assert len(params) == len(every_lora) // 5  # its own share, nothing more
        team.set_active(adapter, trainable=True)
        trainable = {n for n, p in team.model.named_parameters() if p.requires_grad}
        assert trainable and all(adapter_of(n) == adapter for n in trainable)
    assert sum(len(p) for p in chosen.values()) == len(every_lora) == len(set().union(*chosen.values()))


# ---------------------------------------------------------------------- 7. truncation in the runner
def test_runner_bootstraps_a_truncated_episode_from_its_final_observation(random_model_dir, tmp_path):
    """Under a time limit (gymnasium's TimeLimit) the buffer marks the step truncated, not terminated, and stores
    the critic's value of the final observation, which the advantages then use."""
    from gymnasium.wrappers import TimeLimit

    from marft.algorithms import make_trainer
    from marft.config import EnvConfig, RunnerConfig
    from marft.envs.relay_sum.env import RelaySumEnv
    from marft.envs.vector import TextVectorEnv
    from marft.runner.shared.runner import Runner

    torch.manual_seed(0)
    team = make_team(random_model_dir, context_window=256)
    config = TrainConfig(model=team.config, env=EnvConfig(env_name="relay_sum", horizon=5),
                         runner=RunnerConfig(n_rollout_threads=3, episode_length=2, eval_episodes=1, n_eval_threads=1))
    make_env = lambda: TimeLimit(RelaySumEnv(horizon=5), max_episode_steps=1)  # noqa: E731
    trainer = make_trainer(team, config.algo, steps_per_iteration=config.steps_per_iteration)
    runner = Runner(config, team, trainer, TextVectorEnv([make_env] * 3), make_env, tmp_path)
    with torch.no_grad():
        buffer, _ = runner.collector.collect()
    assert buffer.truncated.all() and not buffer.terminated.any()  # wrong answers, cut after one attempt
    assert (buffer.final_values != 0).all()
    trainer.compute_advantages(buffer)
    expected_last = buffer.rewards[:, :, 1] + 0.99 * buffer.final_values - buffer.values[:2, :, 1]  # gamma 0.99
    torch.testing.assert_close(buffer.advantages[:, :, 1], expected_last, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------- 8. schedule units
def test_agent_schedule_counts_env_steps_like_the_original():
    """The original's sample script: --agent_iteration_interval 1000 with 4 envs x 1 step switches agents every
    250 iterations (the agent is (env steps after the iteration // interval) % n_agents); --warmup_steps too."""
    team = type("Team", (), {"n_agents": 2, "agent_adapters": ["a", "b"], "policy_adapters": ["a", "b"], "profile": None})()
    trainer = trainer_class("APPO").__new__(trainer_class("APPO"))
    trainer.team, trainer.steps_per_iteration = team, 4
    trainer.config = AlgoConfig(agent_iteration_interval=1000)
    schedule = [trainer.agents_to_train(i)[0] for i in range(1000)]
    assert schedule[:249] == [0] * 249 and schedule[249:499] == [1] * 250 and schedule[499:749] == [0] * 250
    trainer.config = AlgoConfig(warmup_steps=40)
    assert [trainer.agents_to_train(i) for i in (8, 9, 10)] == [[], [0, 1], [0, 1]]  # 36 < 40 <= 40 env steps
    with pytest.raises(ValueError, match="environment steps"):
        TrainConfig(algo=AlgoConfig(agent_iteration_interval=8)).check()  # 16 envs x 2 steps = 32 env steps per iteration
    help_text = build_parser().format_help()
    assert "environment steps" in " ".join(help_text.split())


# ---------------------------------------------------------------------- 9. given flags survive a resume
ABBREVIATED = [("--num_env", "num_env_steps", "64"), ("--lr", "lr", "0.003"), ("--critic_l", "critic_lr", "0.004"),
               ("--ppo_ep", "ppo_epoch", "3"), ("--save_int", "save_interval", "2"), ("--agent_iter", "agent_iteration_interval", "16")]


@pytest.mark.parametrize("style", ["abbreviated", "equals", "abbreviated_equals"])
def test_flags_given_abbreviated_or_with_equals_survive_a_resume(random_model_dir, tmp_path, style):
    from marft.cli.train import main
    from marft.runner.shared.checkpoint import resume_config

    run = tmp_path / "run"
    base = ["--model_name_or_path", random_model_dir, "--env_name", "relay_sum", "--max_new_tokens", "4", "--context_window", "128",
            "--n_rollout_threads", "2", "--episode_length", "1", "--eval_episodes", "1", "--n_eval_threads", "1"]
    assert main([*base, "--num_env_steps", "2", "--output_dir", str(run)]) == 0
    argv = ["--load_path", str(run)]
    for short, name, value in ABBREVIATED:
        flag = short if style != "equals" else f"--{name}"
        argv += [f"{flag}={value}"] if "equals" in style else [flag, value]
    config, given = parse_config(argv)
    assert {name for _, name, _ in ABBREVIATED} <= given
    resumed = resume_config(config, given)
    for _, name, value in ABBREVIATED:
        section = next(s for s in ("algo", "runner") if hasattr(getattr(resumed, s), name))
        assert str(getattr(getattr(resumed, section), name)) == value or float(getattr(getattr(resumed, section), name)) == float(value), name
    assert resumed.model.max_new_tokens == 4  # not given: from the checkpoint


# ---------------------------------------------------------------------- 11. one registry per choice
def test_choice_flags_help_validation_and_benchmark_read_one_registry():
    for flag, table in CHOICES.items():
        action = next(a for a in build_parser()._actions if a.option_strings == [f"--{flag}"])
        assert action.choices == list(table)
    assert set(TRAINERS) == set(CHOICES["algorithm_name"]) and all(trainer_class(name) for name in TRAINERS)
    with pytest.raises(ValueError, match="APPO, TPPO"):
        AlgoConfig(algorithm_name="PPO")
    help_text = subprocess.run([sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--help"], capture_output=True, text=True, timeout=120).stdout
    for table in CHOICES.values():
        assert "{" + ",".join(table) + "}" in help_text


@pytest.mark.parametrize("update_anyway", [False, True])
@pytest.mark.parametrize("episodes", ["ended", "going_on", "grpo"])
def test_a_batch_that_cannot_rank_replies_moves_the_policies_only_with_update_on_constant_rewards(random_model_dir, update_anyway, episodes):
    """Equal rewards on episodes that all ended (every return the same, nothing bootstrapped), or all-zero
    advantages (GRPO without reward variance): the batch trains the critic only and is counted; with
    --update_on_constant_rewards the policies are updated on it too (the original MARFT's behaviour). Equal rewards
    on a horizon-2 episode that goes on after step 0 are not skipped: the critic's values of the next state still
    rank the replies (issue 30: the skip used to drop them)."""
    torch.manual_seed(0)
    team = make_team(random_model_dir)
    algorithm = "GRPO" if episodes == "grpo" else "APPO"
    trainer = trainer_class(algorithm)(team, AlgoConfig(algorithm_name=algorithm, group_size=4, update_on_constant_rewards=update_anyway), steps_per_iteration=8)
    buffer = fill_buffer(team, trainer=trainer)  # 2 steps; the episodes end after step 1
    if episodes == "ended":
        buffer.terminated.fill_(True)
    buffer.agent_rewards.fill_(1.0)
    buffer.rewards = buffer.played.float()
    trainer.compute_advantages(buffer)
    if algorithm == "APPO":
        assert (buffer.values[1:] != 0).any() and (buffer.advantages != 0).any()
    else:
        assert (buffer.advantages == 0).all()
    before = {a: [p.detach().clone() for p in team.adapter_parameters(a)] for a in team.adapters}
    trainer.update(buffer, 0)
    moved = {a: any(not torch.equal(p, q) for p, q in zip(before[a], team.adapter_parameters(a))) for a in team.adapters}
    skipped = episodes != "going_on" and not update_anyway
    stepped = not skipped and algorithm == "APPO"  # zero advantages (GRPO) give a zero gradient: an update moves nothing
    assert moved == {"reasoner": stepped, "actor": stepped, "critic": algorithm == "APPO"}
    assert trainer.counters["constant_reward_batches"] == int(skipped)
