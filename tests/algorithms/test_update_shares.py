"""The update loop with uneven shares of turns (issue 30, items 2 and 6; the 2-process part of item 3 is in
``tests/runner/test_distributed.py``).

* An adapter with no turns in the batch (an agent the orchestrator never called) is not updated: no optimizer
  step, so neither its weights nor its optimizer state (AdamW's momentum would move it on a zero gradient) change;
  the skip is counted, and many such iterations never stop the run.
* The reference KL is counted in the policy loss's own units (per reply for MARFT-A and GRPO, per reply token
  for MARFT-T): its gradient is that of a plain formula, and does not depend on ``--gradient_cp_steps``.
"""

import copy

import pytest
import torch
from test_rl_audit import one_step_gradients, perturb_adapters
from test_team import fill_buffer, make_team

from marft.algorithms import TRAINERS, trainer_class
from marft.config import AlgoConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def lora(team, adapter) -> dict[str, torch.Tensor]:
    return {id(p): p.detach().clone() for p in team.adapter_parameters(adapter)}


def optimizer_state(optimizer) -> dict:
    return copy.deepcopy(optimizer.state_dict()["state"])


def assert_same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        for name, value in before[key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[key][name])), (key, name)


def without_agent(buffer, agent: int):
    """The buffer as if ``agent`` had never been called: its turns are unplayed slots."""
    buffer.agent = torch.where(buffer.agent == agent, torch.full_like(buffer.agent, -1), buffer.agent)  # -1: an empty slot
    return buffer


@pytest.mark.parametrize("algorithm", sorted(TRAINERS))
def test_an_adapter_without_turns_is_not_stepped(random_model_dir, algorithm):
    """After a real step (so AdamW has momentum), an update on no turns leaves the adapter and its optimizer
    state as they are (per-agent critics too), and is counted."""
    torch.manual_seed(0)
    team = make_team(random_model_dir, critic_mode="per_agent")
    trainer = trainer_class(algorithm)(team, AlgoConfig(algorithm_name=algorithm, group_size=4, ppo_epoch=1), steps_per_iteration=8)
    buffer = fill_buffer(team, trainer=trainer)
    samples = buffer.agent_samples(0, trainer.token_level)
    trainer.update_policy("reasoner", samples)
    critic = "critic_reasoner"
    critic_samples = buffer.critic_samples(trainer.token_level, [0])
    if trainer.uses_critic:
        trainer.update_critic(critic_samples, critic)
    empty = samples.rows(slice(0, 0))
    weights, state = lora(team, "reasoner"), optimizer_state(trainer.policy_optimizers["reasoner"])
    assert state, "the first update made no optimizer state"
    metrics = trainer.update_policy("reasoner", empty)
    assert all(torch.equal(p, weights[id(p)]) for p in team.adapter_parameters("reasoner"))
    assert_same_state(state, optimizer_state(trainer.policy_optimizers["reasoner"]))
    assert trainer.counters["skipped_minibatches"] == 0, "a NaN minibatch, not a skipped update"
    assert trainer.counters["skipped_updates/reasoner"] == 1 and metrics == {}
    if trainer.uses_critic:
        params = [p.detach().clone() for p in team.critic.trainable_parameters(critic)]
        state = optimizer_state(trainer.critic_optimizers[critic])
        trainer.update_critic(critic_samples.rows(slice(0, 0)), critic)
        assert all(torch.equal(a, b) for a, b in zip(params, team.critic.trainable_parameters(critic)))
        assert_same_state(state, optimizer_state(trainer.critic_optimizers[critic]))
        assert trainer.counters[f"skipped_updates/{critic}"] == 1


@pytest.mark.parametrize("algorithm", sorted(TRAINERS))
def test_an_agent_never_called_does_not_stop_the_run(random_model_dir, algorithm):
    """An agent with no turns in 12 updates in a row (more than --max_consecutive_skips 10): the run goes on,
    the other agent trains, the absent agent's adapter stays put."""
    torch.manual_seed(0)
    team = make_team(random_model_dir, critic_mode="per_agent")
    trainer = trainer_class(algorithm)(team, AlgoConfig(algorithm_name=algorithm, group_size=4, ppo_epoch=1), steps_per_iteration=8)
    buffer = without_agent(fill_buffer(team, trainer=trainer), 1)
    absent = team.agent_adapters[1]
    weights = lora(team, absent)
    for iteration in range(12):
        trainer.update(buffer, iteration)
    assert trainer.counters[f"skipped_updates/{absent}"] == 12 and trainer.counters["skipped_minibatches"] == 0
    assert all(torch.equal(p, weights[id(p)]) for p in team.adapter_parameters(absent))


@pytest.mark.parametrize("algorithm", sorted(TRAINERS))
def test_kl_gradient_does_not_depend_on_gradient_cp_steps(random_model_dir, algorithm):
    """kl_coef 1, replies of ragged lengths: the policy gradient with 1 and 2 chunks per minibatch agrees."""
    torch.manual_seed(0)
    team = make_team(random_model_dir)
    perturb_adapters(team, std=0.1)
    results, buffer = {}, None
    for cp in (1, 2):
        trainer, buffer, turns = kl_only_update(team, algorithm, gradient_cp_steps=cp, buffer=buffer)
        results[cp] = one_step_gradients(trainer, trainer.update_policy, "reasoner", turns)
        team.set_active(None)
    assert len(results[1]) == len(results[2]) > 0 and any(g.abs().sum() > 0 for g in results[1])
    for a, b in zip(results[1], results[2]):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-4)


def kl_only_update(team, algorithm: str, gradient_cp_steps: int = 1, buffer=None, mode: str = "sum"):
    """A trainer with ``kl_coef`` 1, no standardised advantages, and agent 0's turns of a buffer with ragged
    replies (filled unless ``buffer`` is given) whose advantages are all 0: the update's gradient is the KL's alone.
    Returns the trainer, the buffer and agent 0's turns."""
    config = AlgoConfig(algorithm_name=algorithm, group_size=4, ppo_epoch=1, gradient_cp_steps=gradient_cp_steps, num_mini_batch=1,
                        kl_coef=1.0, normalize_advantages=False, normalization_mode=mode)
    trainer = trainer_class(algorithm)(team, config, steps_per_iteration=8)
    if buffer is None:
        torch.manual_seed(0)
        buffer = fill_buffer(team, trainer=trainer)
        lengths = torch.tensor([1, 6, 2, 6, 1, 5, 1, 6])  # (T·E,) ragged reply lengths, the same for every agent
        ragged = (torch.arange(buffer.response_mask.shape[-1]) < lengths.view(2, 4, 1, 1)).long()  # (T, E, 1, L)
        buffer.response_mask = buffer.response_mask * ragged
        trainer.compute_advantages(buffer)
    samples = buffer.agent_samples(0, trainer.token_level)
    for key in ("advantages", "token_advantages"):  # the KL alone
        if getattr(samples, key) is not None:
            setattr(samples, key, torch.zeros_like(getattr(samples, key)))
    return trainer, buffer, samples


@pytest.mark.parametrize("algorithm, mode", [("APPO", "sum"), ("APPO", "token"), ("APPO", "word"), ("TPPO", "sum"), ("GRPO", "sum"),
                                             ("GRPO", "token"), ("GRPO", "word")])
def test_kl_is_weighed_in_the_policy_losss_units(random_model_dir, algorithm, mode):
    """The KL term's gradient is that of kl_coef · Σ_replies KL_reply / units, in the policy loss's own units:
    with one ratio per reply (MARFT-A, GRPO's sum and word modes) KL_reply is the reply's token k3 combined as its
    log-prob is (summed, or per word) and the units are the replies; with a loss per token (MARFT-T, GRPO's token
    mode) the units are the real reply tokens (MARFT-A's token mode: the per-token mean of a reply over replies).
    So each token weighs the KL against its advantage alike, whatever the reply's length."""
    torch.manual_seed(0)
    team = make_team(random_model_dir)
    perturb_adapters(team, std=0.1)
    trainer, _, turns = kl_only_update(team, algorithm, mode=mode)
    fast = one_step_gradients(trainer, trainer.update_policy, "reasoner", turns)
    team.set_active("reasoner", trainable=True)
    mb = turns.trimmed(team.device)
    reference = trainer.reference_logprobs(mb, "reasoner")  # (B, L)
    token_logp, _ = trainer.score_replies("reasoner", mb)  # (B, L)
    mask = mb.response_mask.float()
    assert mask.sum() > mask.shape[0], "replies of one token: replies and tokens would be the same units"
    r = (reference - token_logp) * mask
    k3 = (torch.exp(r) - r - 1) * mask  # (B, L)
    per_token = algorithm == "TPPO" or (algorithm == "GRPO" and mode == "token")
    if per_token:
        k3, units = k3.sum(), mask.sum()
    else:
        per_reply = k3.sum(-1) / {"sum": torch.ones(len(mask)), "token": mask.sum(-1), "word": mb.n_words.float()}[mode].clamp(min=1)
        k3, units = per_reply.sum(), float(mask.shape[0])
    params = list(team.adapter_parameters("reasoner"))
    for p in params:
        p.grad = None
    (k3 / units).backward()
    plain = [torch.zeros_like(p) if p.grad is None else p.grad for p in params]
    team.set_active(None)
    assert any(g.abs().sum() > 0 for g in plain)
    for a, b in zip(fast, plain):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-4)
