"""The built ``marft-tiny-instruct`` (the real recipe, cached like ``marft-tiny``) speaks through its chat template:
every prompt is a ChatML chat, replies end with ``<|im_end|>``, its orchestrator writes valid ``<call>``/``<done/>``
tags before any RL (routing at random), and its code team writes ```` ```python ```` programs that pass some of the
hidden tests. This is the path instruct models (Qwen2.5-Instruct, Llama-3-Instruct) take, trained and tested here."""

import torch

from marft.config import AlgoConfig, EnvConfig, ModelConfig, RunnerConfig, TrainConfig
from marft.envs.code.problem import last_python_block
from marft.envs.workflows import OrchestratedWorkflow
from marft.launch import build_runner, seed_everything

N_ENVS = 32


def rollout(tmp_path, **env):
    """One rollout of ``N_ENVS`` one-step episodes on the embedded instruct model: ``(runner, buffer)``."""
    code = env.get("env_name") == "code"
    config = TrainConfig(
        model=ModelConfig(model_name_or_path="marft-tiny-instruct", profile_path="reasoner_actor_code" if code else "route_orchestrated",
                          max_new_tokens=24 if code else 16, context_window=256),
        env=EnvConfig(**env),
        algo=AlgoConfig(algorithm_name="APPO"),
        runner=RunnerConfig(n_rollout_threads=N_ENVS, episode_length=1, num_env_steps=N_ENVS, seed=0, output_dir=str(tmp_path)),
    )
    seed_everything(0)
    runner = build_runner(config)
    buffer, _ = runner.collector.collect()
    return runner, buffer


def replies(runner, buffer, agent: int) -> list[str]:
    """The decoded replies of ``agent``'s turns (special tokens kept), in (env, slot) order."""
    samples = buffer.agent_samples(agent)
    return [runner.team.tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(samples.response_ids, samples.response_mask)]


def test_the_orchestrator_writes_the_tags_through_the_chat_template(tmp_path, one_thread):
    runner, buffer = rollout(tmp_path, env_name="route", workflow="orchestrated")
    tokenizer = runner.team.tokenizer
    assert runner.team.prompts.uses_chat_template
    for agent in range(3):
        samples = buffer.agent_samples(agent)
        for ids, mask in zip(samples.prompt_ids, samples.prompt_mask):
            prompt = tokenizer.decode(ids[mask.bool()])
            assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    samples = buffer.agent_samples(2)
    lengths = samples.response_mask.sum(-1).tolist()
    ended = [text.endswith("<|im_end|>") or n == runner.team.backend.settings.max_new_tokens
             for text, n in zip(replies(runner, buffer, 2), lengths)]
    assert all(ended)  # each reply ends with the assistant turn's end, or fills the reply budget (16 tokens)
    workflow = OrchestratedWorkflow(("Keeper 1", "Keeper 2", "Orchestrator"), (0, 1), orchestrator=2)
    assert bool((buffer.agent[0, :, 0] == 2).all())  # slot 0: the orchestrator opens every step
    first_turns = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(buffer.response_ids[0, :, 0], buffer.response_mask[0, :, 0])]
    parsed = [workflow.parse(text.removesuffix("<|im_end|>")) for text in first_turns]
    assert sum(p is not None for p in parsed) >= 0.9 * len(parsed)  # valid tags before any RL
    calls = [p for p in parsed if p is not None and p >= 0]
    assert calls.count(0) > 0.2 * len(calls) and calls.count(1) > 0.2 * len(calls)  # it calls both: routing at random
    accuracy = float(buffer.agent_rewards[0, :, 0].mean())
    assert 0.2 < accuracy < 0.8  # right about half the time: RL has to learn whom to call


def test_the_code_team_writes_programs_through_the_chat_template(tmp_path, one_thread):
    runner, buffer = rollout(tmp_path, env_name="code")
    programs = replies(runner, buffer, 1)
    assert sum(last_python_block(text) is not None for text in programs) >= 0.9 * len(programs)
    rewards = buffer.agent_rewards[0, :, 1]
    assert 0.0 < float(rewards.mean()) < 0.9 and bool((rewards == 1.0).any())  # some programs pass every hidden test
    assert torch.all((0 <= rewards) & (rewards <= 1))
