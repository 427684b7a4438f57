"""``--critic_init policy``: RL from a warm start begins each critic adapter as a copy of the policy adapter whose
turns it values (the value model started from the SFT model), and nothing else changes; ``fresh`` (the default)
keeps the checkpoint's critic, and a resumed RL run keeps its own critic either way."""

from __future__ import annotations

import json
import re

import pytest
import torch

from marft.agents.adapters import adapter_of
from marft.config import AlgoConfig, EnvConfig, ModelConfig, RunnerConfig, TrainConfig
from marft.launch import build_runner

pytestmark = pytest.mark.usefixtures("one_thread")


def config(model_dir, run, load_path=None, **model) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(model_name_or_path=model_dir, max_new_tokens=6, context_window=128, **model),
        env=EnvConfig(env_name="dense_relay_sum", horizon=2),
        algo=AlgoConfig(ppo_epoch=1, num_mini_batch=1),
        runner=RunnerConfig(n_rollout_threads=2, episode_length=1, num_env_steps=4, output_dir=str(run),
                            load_path=str(load_path) if load_path else None),
    )


def lora(team, adapter) -> dict[str, torch.Tensor]:
    """An adapter's LoRA weights, keyed by their names with the adapter's segment taken out."""
    return {n.replace(f".{adapter}.", ".<a>."): p.detach().clone() for n, p in team.model.named_parameters() if adapter_of(n) == adapter}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def warm_start(random_model_dir, tmp_path_factory):
    """``marft sft``'s checkpoint (per-agent critics, as --critic_mode per_agent saves them): its policy adapters
    trained, its critics not."""
    from marft.cli.sft import main as sft_main

    tmp = tmp_path_factory.mktemp("warm")
    episode = {"problem": "What is x + 50?", "turns": [{"role": "Reasoner", "text": "7 + 50 = 57"}, {"role": "Actor", "text": "\\boxed{57}"}]}
    (tmp / "t.jsonl").write_text(json.dumps(episode) + "\n")
    args = ["--model_name_or_path", random_model_dir, "--env_name", "dense_relay_sum", "--max_new_tokens", "6",
            "--context_window", "128", "--n_rollout_threads", "2", "--critic_mode", "per_agent",
            "--sft_steps", "2", "--sft_data", str(tmp / "t.jsonl"), "--output_dir", str(tmp / "sft")]
    assert sft_main(args) == 0
    return tmp / "sft" / "checkpoints" / "steps_0"


def started(random_model_dir, run, load_path, **model):
    runner = build_runner(config(random_model_dir, run, load_path, critic_mode="per_agent", **model))
    runner.restore(load_path)
    loaded = {a: lora(runner.team, a) for a in runner.team.adapters}
    heads = {c: h.weight.detach().clone() for c, h in runner.team.critic.value_heads.items()}
    runner.init_critics()
    return runner, loaded, heads


def test_policy_init_copies_each_agents_policy_into_its_critic_and_changes_nothing_else(random_model_dir, warm_start, tmp_path, caplog):
    with caplog.at_level("INFO", logger="marft"):
        runner, loaded, heads = started(random_model_dir, tmp_path / "rl", warm_start, critic_init="policy")
    team = runner.team
    assert team.critic_adapters == ["critic_reasoner", "critic_actor"]
    for policy in team.policy_adapters:
        critic = f"critic_{policy}"
        assert not same(loaded[critic], loaded[policy]), "the warm start's critic should differ from its policy"
        assert same(lora(team, critic), loaded[policy])  # the critic is now the policy's copy ...
        assert same(lora(team, policy), loaded[policy])  # ... and the policy is as it was
    assert all(torch.equal(h.weight, heads[c]) for c, h in team.critic.value_heads.items())  # the heads stay new
    assert "critic_reasoner starts as a copy of reasoner, critic_actor starts as a copy of actor" in caplog.text

    # the critic then values a turn from the policy's own features: its last hidden state is the policy's
    prompt = team.tokenizer("What is x + 50?", return_tensors="pt").input_ids
    hidden = {}
    for adapter in ("reasoner", "critic_reasoner"):
        team.bank.route(adapter)
        with torch.no_grad():
            hidden[adapter] = team.model(input_ids=prompt, output_hidden_states=True).hidden_states[-1][0, -1]
    torch.testing.assert_close(hidden["reasoner"], hidden["critic_reasoner"], rtol=0, atol=0)


def test_fresh_keeps_the_checkpoints_critic(random_model_dir, warm_start, tmp_path):
    runner, loaded, _ = started(random_model_dir, tmp_path / "rl", warm_start)  # the default
    assert runner.config.model.critic_init == "fresh"
    assert all(same(lora(runner.team, a), loaded[a]) for a in runner.team.adapters)


def test_a_resumed_rl_run_keeps_its_critic(random_model_dir, warm_start, tmp_path):
    runner, _, _ = started(random_model_dir, tmp_path / "rl", warm_start, critic_init="policy")
    buffer, _ = runner.collector.collect(0)
    runner.trainer.compute_advantages(buffer)
    runner.trainer.update(buffer, 0)
    saved = runner.save(1)
    trained = {a: lora(runner.team, a) for a in runner.team.adapters}
    assert not same(trained["critic_reasoner"], trained["reasoner"])  # both trained apart
    resumed, loaded, _ = started(random_model_dir, tmp_path / "resumed", saved, critic_init="policy")
    assert not resumed.starts_rl
    assert all(same(lora(resumed.team, a), trained[a]) for a in resumed.team.adapters)


@pytest.mark.parametrize("flags,message", [
    ({"critic_mode": "shared"}, "--critic_init policy: the critic adapter 'critic' values the turns of 2 policy adapters (actor, reasoner)"),
    ({"algorithm_name": "GRPO"}, "--critic_init policy: --algorithm_name GRPO trains no critic"),
])
def test_policy_init_without_one_policy_per_critic_is_refused_before_loading(random_model_dir, tmp_path, flags, message):
    cfg = config(random_model_dir, tmp_path / "rl", critic_init="policy", critic_mode=flags.get("critic_mode", "per_agent"))
    if "algorithm_name" in flags:
        cfg.algo = AlgoConfig(algorithm_name="GRPO", group_size=2)
        cfg.runner.episode_length = 2  # GRPO plays whole episodes (--horizon 2)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        build_runner(cfg)


def test_policy_init_with_one_shared_adapter_copies_it(random_model_dir, tmp_path):
    """--shared_lora: one policy adapter, so the one shared critic has a source (here a run without --load_path:
    the critic starts as the fresh policy's copy)."""
    runner = build_runner(config(random_model_dir, tmp_path / "rl", critic_init="policy", shared_lora=True))
    runner.init_critics()
    assert same(lora(runner.team, "critic"), lora(runner.team, "shared"))
