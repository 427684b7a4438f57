"""``--max_update_kl`` (issue 74): how far one update may move a policy, measured after the update on its batch.

The line search against a plain quadratic "KL", the k3 sum against the formula, and a real update: bounded, it
keeps exactly a halved share of the unbounded update's step (same gradients, same Adam step), its measured KL is
within the limit, and a limit never reached changes no weight.
"""

import copy
import math

import pytest
import torch

from marft.algorithms import trust_region
from marft.algorithms.trust_region import MAX_HALVINGS, batch_update_kl, bound_update, token_kl_sum
from marft.config import AlgoConfig, EnvConfig, ModelConfig, RunnerConfig, TrainConfig
from marft.launch import build_runner

pytestmark = pytest.mark.usefixtures("one_thread")


def test_token_kl_sum_is_the_k3_estimate_over_real_tokens():
    torch.manual_seed(0)
    old, new = -torch.rand(3, 5) * 3, -torch.rand(3, 5) * 3  # (B, L) log-probs
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]])
    total, count = token_kl_sum(new, old, mask)
    expected = sum(math.exp(new[b, t] - old[b, t]) - 1 - (new[b, t] - old[b, t])
                   for b in range(3) for t in range(5) if mask[b, t])
    assert count == 9 and total == pytest.approx(float(expected), rel=1e-5)
    assert token_kl_sum(old, old, mask) == (0.0, 9.0)


def quadratic(params, before, curvature=10.0):
    """A stand-in for the batch KL: ``curvature * |params - before|**2``, so halving the step quarters it."""
    return lambda: curvature * sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(params, before))


def test_a_step_within_the_limit_is_kept_whole():
    before = [torch.zeros(2), torch.zeros(3)]
    params = [torch.nn.Parameter(torch.full((2,), 0.1)), torch.nn.Parameter(torch.full((3,), -0.1))]
    bounded = bound_update(params, before, quadratic(params, before), limit=1.0)  # KL 0.5
    assert (bounded.scale, bounded.halvings) == (1.0, 0) and bounded.kl == pytest.approx(0.5)
    assert torch.equal(params[0].detach(), torch.full((2,), 0.1))


def test_a_step_over_the_limit_is_halved_until_within_it():
    before = [torch.randn(4), torch.randn(2, 2)]
    full = [b + torch.full_like(b, 0.25) for b in before]  # KL 10 * 8 * 0.0625 = 5
    params = [torch.nn.Parameter(f.clone()) for f in full]
    bounded = bound_update(params, before, quadratic(params, before), limit=1.0)  # 5 -> 1.25 -> 0.3125
    assert (bounded.scale, bounded.halvings) == (0.25, 2) and bounded.kl == pytest.approx(0.3125)
    for param, start, end in zip(params, before, full):
        torch.testing.assert_close(param.detach(), start + 0.25 * (end - start))


def test_a_step_still_over_the_limit_at_the_smallest_scale_is_undone():
    before = [torch.randn(3)]
    params = [torch.nn.Parameter(before[0] + 1.0)]
    calls = []

    def always_far():  # e.g. a sampler whose probabilities differ from the trainer's whatever the step
        calls.append(1)
        return 5.0

    bounded = bound_update(params, before, always_far, limit=1.0)
    assert bounded.scale == 0.0 and bounded.halvings == MAX_HALVINGS and math.isnan(bounded.kl)
    assert len(calls) == 1 + MAX_HALVINGS
    assert torch.equal(params[0].detach(), before[0])


# ---------------------------------------------------------------------- a real update
def grpo_config(model_dir, tmp_path, lora_dropout=0.0, **algo) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(model_name_or_path=model_dir, max_new_tokens=6, context_window=128, lora_dropout=lora_dropout),
        env=EnvConfig(env_name="dense_relay_sum"),
        algo=AlgoConfig(algorithm_name="GRPO", group_size=2, lr=0.05, ppo_epoch=2, update_on_constant_rewards=True, **algo),
        runner=RunnerConfig(n_rollout_threads=6, episode_length=2, num_env_steps=24, eval_episodes=2, n_eval_threads=2,
                            output_dir=str(tmp_path / "run")),
    )


def policy_weights(team) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in team.model.named_parameters() if "lora_" in n}


def update_from(runner, buffer, weights, optimizer_states, limit):
    """One update of the batch from the same weights and optimizer states, under ``--max_update_kl limit``."""
    team, trainer = runner.team, runner.trainer
    with torch.no_grad():
        for name, param in team.model.named_parameters():
            if name in weights:
                param.copy_(weights[name])
    for adapter, state in optimizer_states.items():
        trainer.policy_optimizers[adapter].load_state_dict(copy.deepcopy(state))
    trainer.config.max_update_kl = limit
    torch.manual_seed(0)  # the same minibatch order
    metrics = trainer.update(copy.deepcopy(buffer), 0)
    return metrics, policy_weights(team)


def metric_labels(runner) -> dict[str, str]:
    """Each policy adapter's label in the update's metrics (``agent_<role>/...``)."""
    team = runner.team
    groups = runner.trainer.adapter_groups(list(range(team.n_agents)))
    return {adapter: f"agent_{team.profile[group[0]].role if len(group) == 1 else adapter}" for adapter, group in groups.items()}


def test_a_bounded_update_keeps_a_halved_share_of_the_unbounded_step(random_model_dir, tmp_path, monkeypatch):
    runner = build_runner(grpo_config(random_model_dir, tmp_path))
    team, trainer = runner.team, runner.trainer
    labels = metric_labels(runner)
    buffer, _ = runner.collector.collect(0)
    trainer.compute_advantages(buffer)
    start = policy_weights(team)
    states = {a: copy.deepcopy(o.state_dict()) for a, o in trainer.policy_optimizers.items()}

    free, free_weights = update_from(runner, buffer, start, states, limit=None)
    loose, loose_weights = update_from(runner, buffer, start, states, limit=1e9)
    assert all(torch.equal(free_weights[n], loose_weights[n]) for n in start)  # measuring alone changes nothing
    assert not any(k.endswith("/update_kl") for k in free)
    full_kl = {a: loose[f"{labels[a]}/update_kl"] for a in team.policy_adapters}
    assert all(kl > 0 for kl in full_kl.values()) and all(loose[f"{labels[a]}/update_step_scale"] == 1 for a in labels)

    limit = min(full_kl.values()) / 3  # every adapter's whole step is over it
    measured = []
    measure = trust_region.batch_update_kl
    monkeypatch.setattr(trust_region, "batch_update_kl", lambda *args: measured.append(measure(*args)) or measured[-1])
    bounded, bounded_weights = update_from(runner, buffer, start, states, limit=limit)
    scales = {a: bounded[f"{labels[a]}/update_step_scale"] for a in team.policy_adapters}
    assert all(0 < scale < 1 for scale in scales.values()), scales
    assert all(bounded[f"{labels[a]}/update_kl"] <= limit for a in team.policy_adapters), (bounded, limit)
    assert len(measured) > len(team.policy_adapters) and trainer.counters["cut_updates"] == len(team.policy_adapters)
    for name in start:  # each adapter's weights: where they started plus its scale times the unbounded step
        adapter = name.split("lora_")[1].split(".")[1]
        expected = start[name] + scales[adapter] * (free_weights[name] - start[name])
        torch.testing.assert_close(bounded_weights[name], expected, rtol=1e-5, atol=1e-7)
    assert sum(not torch.equal(bounded_weights[n], start[n]) for n in start) > 0


def test_the_measure_is_the_mean_kl_of_the_batch_tokens_without_lora_dropout(random_model_dir, tmp_path):
    """With the update's weights unchanged the batch KL is that of the sampler against the trainer (0 up to
    numerics), and LoRA dropout, active in the update, is off while it is measured."""
    runner = build_runner(grpo_config(random_model_dir, tmp_path, lora_dropout=0.5, max_update_kl=0.01))
    team, trainer = runner.team, runner.trainer
    buffer, _ = runner.collector.collect(0)
    trainer.compute_advantages(buffer)
    adapter = team.policy_adapters[0]
    samples = buffer.agent_samples(trainer.adapter_groups(list(range(team.n_agents)))[adapter], trainer.token_level)
    with team.bank.lora_dropout_active():
        kl = batch_update_kl(team, trainer.config, samples, adapter, trainer.dist)
        assert all(module.training for module in team.bank.lora_dropouts)  # back on after the measure
    assert team.bank.lora_dropouts and 0 <= kl < 1e-5
