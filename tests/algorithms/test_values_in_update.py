"""``--values_in_update``: the update's first critic forward values the rollout's turns (no critic forward in the
rollout). Compared with the plain way, where the rollout values every turn: the same values, advantages and
updated weights (to float32 rounding), for both trainers with a critic and both critic modes; turned on only
where it is exact and its memory is within the update's budget; and a whole training run equal to the plain one."""

import copy

import pytest
import torch
from test_team import fill_buffer, make_team

from marft.algorithms import trainer_class
from marft.config import AlgoConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def weights(team) -> dict[str, torch.Tensor]:
    """Every adapter weight and value head, detached copies."""
    out = {name: p.detach().clone() for name, p in team.model.named_parameters() if "lora_" in name}
    out.update({f"head.{name}": p.detach().clone() for name, p in team.critic.value_heads.named_parameters()})
    return out


def restore(team, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if name in saved:
                p.copy_(saved[name])
        for name, p in team.critic.value_heads.named_parameters():
            p.copy_(saved[f"head.{name}"])


def assert_same_update(after: torch.Tensor, expected: torch.Tensor, before: torch.Tensor, name: str) -> None:
    """``after`` equals ``expected`` within 1 % of the tensor's whole move (the norm of the difference against the norm
    of ``expected - before``), and no weight by more than 20 % of the largest move. Adam's steps are about the learning
    rate whatever the gradient's size, so a weight whose gradient is ~0 may move either way on float32 rounding: only
    such weights differ, by a share of the step that depends on the CPU's float32 sums. A skipped or misplaced critic
    step moves whole tensors."""
    move = float((expected - before).norm())
    gap = float((after - expected).norm())
    assert gap <= 0.01 * move + 1e-7, f"{name}: differs by {gap:.3g}, {gap / max(move, 1e-12):.1%} of its move {move:.3g}"
    step, widest = float((expected - before).abs().max()), float((after - expected).abs().max())
    assert widest <= 0.2 * step + 1e-7, f"{name}: a weight differs by {widest:.3g}, {widest / max(step, 1e-12):.1%} of the largest step {step:.3g}"


@pytest.mark.parametrize("critic_mode", ["shared", "per_agent"])
@pytest.mark.parametrize("algorithm", ["APPO", "TPPO"])
def test_values_from_the_update_equal_the_rollouts_and_so_does_the_update(random_model_dir, algorithm, critic_mode):
    """One rollout (ragged replies, values from the rollout) updated both ways from the same weights: the update's
    values equal the rollout's, so do the advantages, and after two PPO epochs every adapter and value head equals
    the plain way's; the critic really moved, and the critic forward ran once fewer."""
    torch.manual_seed(0)
    team = make_team(random_model_dir, critic_mode=critic_mode)
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_B" in name:  # adapters that change the values and replies
                p.normal_(std=0.05)
    config = AlgoConfig(algorithm_name=algorithm, ppo_epoch=2, lr=1e-2, critic_lr=1e-2, update_on_constant_rewards=True)
    plain = trainer_class(algorithm)(team, config, steps_per_iteration=8)
    buffer = fill_buffer(team, trainer=plain)  # rollout values, advantages
    rollout_values, token_values = buffer.values.clone(), buffer.token_values.clone()
    assert rollout_values[:2].abs().sum() > 0
    start = weights(team)
    deferred_buffer = copy.deepcopy(buffer)
    deferred_buffer.values[:-1] = 0.0
    deferred_buffer.token_values.zero_()
    results = {}
    for name, the_buffer in (("plain", buffer), ("deferred", deferred_buffer)):
        restore(team, start)
        trainer = trainer_class(algorithm)(team, config, steps_per_iteration=8)
        trainer.values_in_update = name == "deferred"
        forwards = []
        original = trainer.critic_values
        trainer.critic_values = lambda mb, critic=None, forwards=forwards, original=original: forwards.append(len(mb)) or original(mb, critic)
        torch.manual_seed(1)
        trainer.compute_advantages(the_buffer)
        trainer.update(the_buffer, 0)
        results[name] = (weights(team), forwards)
    if algorithm == "APPO":
        torch.testing.assert_close(deferred_buffer.values, rollout_values, atol=2e-5, rtol=0)
        torch.testing.assert_close(deferred_buffer.advantages, buffer.advantages, atol=1e-4, rtol=0)
    else:
        torch.testing.assert_close(deferred_buffer.token_values, token_values, atol=2e-5, rtol=0)
        torch.testing.assert_close(deferred_buffer.token_advantages, buffer.token_advantages, atol=1e-4, rtol=0)
    plain_weights, plain_forwards = results["plain"]
    deferred_weights, deferred_forwards = results["deferred"]
    assert sum(deferred_forwards) == sum(plain_forwards) == 2 * 2 * 4 * 2  # 2 epochs x T=2 x E=4 x 2 agents: no extra forward
    moved = [name for name in start if not torch.equal(start[name], deferred_weights[name])]
    assert any("critic" in name for name in moved) and any(name.startswith("head.") for name in moved)
    for name in start:
        assert_same_update(deferred_weights[name], plain_weights[name], start[name], name)


@pytest.mark.parametrize(
    "change,expected",
    [({}, True), ({"values_in_update": False}, False), ({"num_mini_batch": 2}, False), ({"max_chunk_mib": 0}, False),
     ({"max_chunk_tokens": 799}, False), ({"max_chunk_tokens": 8 * 100}, True), ({"lora_dropout": 0.1}, False)],
)
def test_values_come_from_the_update_only_where_exact_and_within_the_budget(random_model_dir, change, expected):
    """8 turns of 100 positions: on by default; off when asked, with several minibatches (the first epoch's forward
    would not see every turn before a step), without a budget or a budget below the turns' positions, and with LoRA
    dropout (the update's values would not be the rollout's)."""
    dropout = change.pop("lora_dropout", 0.0)
    team = make_team(random_model_dir, lora_dropout=dropout)
    for algorithm in ("APPO", "TPPO"):
        trainer = trainer_class(algorithm)(team, AlgoConfig(algorithm_name=algorithm, **change), steps_per_iteration=8)
        assert trainer.can_value_in_update(8, 100) is expected
    assert not trainer_class("GRPO")(team, AlgoConfig(algorithm_name="GRPO"), steps_per_iteration=8).values_in_update


def test_a_nonfinite_value_loss_skips_the_kept_step_and_keeps_the_weights(random_model_dir):
    """A NaN return on the first epoch's kept forward: the step is skipped (counted), no weight moves."""
    torch.manual_seed(0)
    team = make_team(random_model_dir)
    trainer = trainer_class("APPO")(team, AlgoConfig(ppo_epoch=1, max_consecutive_skips=10), steps_per_iteration=8)
    trainer.values_in_update = True
    buffer = fill_buffer(team, trainer=trainer)
    buffer.returns[0, 0, 0] = float("nan")
    before = weights(team)
    trainer.update_critics(buffer)
    assert trainer.counters["skipped_minibatches"] == 1
    after = weights(team)
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("algorithm", ["APPO", "TPPO"])
def test_a_training_run_with_values_from_the_update_equals_the_plain_run(random_model_dir, tmp_path, algorithm):
    """Two iterations of the runner on relay_sum each way from the same weights and seed: with the update's values
    the rollout runs no critic on its turns (the buffer holds none until the advantages phase), and the trained
    weights equal the plain run's (the same replies are sampled: the random draws are the same)."""
    from marft.algorithms import make_trainer
    from marft.config import EnvConfig, RunnerConfig, TrainConfig
    from marft.envs.relay_sum.env import RelaySumEnv
    from marft.envs.vector import TextVectorEnv
    from marft.runner.shared.runner import Runner

    torch.manual_seed(0)
    team = make_team(random_model_dir, context_window=256)
    start = weights(team)
    trained = {}
    for values_in_update in (False, True):
        restore(team, start)
        config = TrainConfig(model=team.config, env=EnvConfig(env_name="relay_sum", horizon=2),
                             algo=AlgoConfig(algorithm_name=algorithm, values_in_update=values_in_update, update_on_constant_rewards=True),
                             runner=RunnerConfig(n_rollout_threads=3, episode_length=2, eval_episodes=1, n_eval_threads=1, seed=3))
        make_env = lambda: RelaySumEnv(horizon=2)  # noqa: E731
        trainer = make_trainer(team, config.algo, steps_per_iteration=config.steps_per_iteration)
        runner = Runner(config, team, trainer, TextVectorEnv([make_env] * 3), make_env, tmp_path / str(values_in_update))
        assert trainer.values_in_update is values_in_update and runner.collector.needs.turn_values is not values_in_update
        torch.manual_seed(5)
        for iteration in range(2):
            with torch.no_grad():
                buffer, _ = runner.collector.collect(iteration)
            turn_values = buffer.token_values if trainer.token_level else buffer.values[:2]  # what the advantages read
            assert bool(turn_values.abs().sum() == 0) is values_in_update
            trainer.compute_advantages(buffer)
            assert turn_values.abs().sum() > 0
            trainer.update(buffer, iteration)
        trained[values_in_update] = weights(team)

    def out_of_memory(buffer):
        raise torch.OutOfMemoryError("CUDA out of memory")

    trainer.compute_advantages = out_of_memory  # the last runner's: values from the update
    with pytest.raises(torch.OutOfMemoryError, match="--values_in_update false"):
        runner._advantages(buffer, 0)
    moved = [name for name in start if not torch.equal(start[name], trained[True][name])]
    assert any("critic" in name for name in moved) and any("critic" not in name and not name.startswith("head.") for name in moved)
    for name in start:
        assert_same_update(trained[True][name], trained[False][name], start[name], name)


def saved_bytes_of_value_turns(random_model_dir, **model_flags) -> int:
    """Bytes the kept forwards of :meth:`value_turns` save for their backward (one APPO rollout of 2 x 4 x 2 turns)."""
    torch.manual_seed(0)
    team = make_team(random_model_dir, **model_flags)
    trainer = trainer_class("APPO")(team, AlgoConfig(ppo_epoch=1), steps_per_iteration=8)
    buffer = fill_buffer(team, trainer=trainer)
    trainer.values_in_update = True
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        trainer.compute_advantages(buffer)
    trainer.update_critics(buffer)  # the kept forwards backward fine
    return sum(saved)


def test_the_kept_forward_is_checkpointed_under_gradient_checkpointing(random_model_dir):
    """--gradient_checkpointing lets the budget count one hidden vector per layer and position: the kept forward
    must save that little too (it runs as the update's forward does), not every layer's activations."""
    plain = saved_bytes_of_value_turns(random_model_dir)
    checkpointed = saved_bytes_of_value_turns(random_model_dir, gradient_checkpointing=True)
    assert checkpointed < 0.5 * plain


def test_no_critics_kept_forward_lives_through_another_critics_epochs(random_model_dir):
    """Per-agent critics, two epochs: every kept forward's step runs before any critic's second epoch draws its
    minibatches, so at most one epoch's chunk is held beside nothing kept."""
    torch.manual_seed(0)
    team = make_team(random_model_dir, critic_mode="per_agent")
    trainer = trainer_class("APPO")(team, AlgoConfig(ppo_epoch=2), steps_per_iteration=8)
    trainer.values_in_update = True
    buffer = fill_buffer(team, trainer=trainer)
    assert len(trainer.kept_values) == 2
    held = []
    original = trainer._minibatches
    trainer._minibatches = lambda samples, chunks: held.append(len(trainer.kept_values)) or original(samples, chunks)
    trainer.update_critics(buffer)
    assert held == [0, 0]  # each critic's second epoch, with no kept forward left
