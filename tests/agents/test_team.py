"""The agent team on one base model: scoring, masks, truncation and which parameters train."""

import dataclasses

import pytest
import torch
from team_oracle import play_step

from marft.agents.generation import reply_mask
from marft.agents.team import AgentTeam
from marft.algorithms import TRAINERS, trainer_class
from marft.algorithms.advantages import fill_action_advantages
from marft.algorithms.appo_trainer import APPOTrainer
from marft.algorithms.tppo_trainer import TPPOTrainer
from marft.config import AlgoConfig, ModelConfig
from marft.envs.profile import AgentSpec, load_profile
from marft.models.loading import load_base_model
from marft.runner.shared.buffer import RolloutBuffer

HISTORIES = [
    "Problem: What is 3 + 4?\n",
    "Problem: What is 13 - 4?\nReasoner: 13 - 4 = 9\nActor: \\boxed{8}\nJudge: wrong, try again\n",
    "Problem: What is 1 + 1?\n",
]


MIXED_PROFILE = [AgentSpec("Reasoner", "", False), AgentSpec("Actor", "You are the Actor. Box the answer.", True)]
"""A team where one agent has a role header and the other none."""


def make_team(model_dir, **overrides):
    config = ModelConfig(**{"model_name_or_path": model_dir, "max_new_tokens": 6, "context_window": 96, **overrides})
    model, tokenizer = load_base_model(config)
    return AgentTeam(model, tokenizer, load_profile("reasoner_actor", n_agents=2), config)


def reference_logprobs(team, adapter, prompt_ids, prompt_mask, response_ids, response_mask):
    """One unpadded sequence at a time, full-vocabulary log-softmax of the tempered logits at every reply
    position (top-k narrows sampling only; the policy's log-probs are of the untruncated distribution)."""
    team.model.set_adapter(adapter)
    rows = []
    for p, pm, r, rm in zip(prompt_ids, prompt_mask, response_ids, response_mask):
        prompt = p[pm.bool()]
        reply = r[: int(rm.sum())]
        ids = torch.cat([prompt, reply]).unsqueeze(0)
        logits = team.model(input_ids=ids).logits[0].float() / team.config.temperature
        logp = torch.log_softmax(logits, -1)
        row = torch.zeros(response_ids.shape[1])
        for t in range(len(reply)):
            row[t] = logp[len(prompt) - 1 + t, reply[t]]
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_rollout_logprobs_match_plain_reference(random_model_dir, temperature, top_k):
    torch.manual_seed(0)
    team = make_team(random_model_dir, temperature=temperature, top_k=top_k)
    out = team.act(1, HISTORIES, [[("Reasoner", "hi")], [("Reasoner", "a longer reply here")], []])
    with torch.no_grad():
        ref = reference_logprobs(team, team.agent_adapters[1], out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
    torch.testing.assert_close(out.logprobs, ref, atol=1e-5, rtol=0)
    assert (out.logprobs[out.response_mask == 0] == 0).all()
    if top_k:
        assert torch.isfinite(out.logprobs).all()


@pytest.mark.parametrize("context_window", [256, 72])  # 72: long histories are cut from the left
def test_generation_with_a_shared_role_header_samples_as_plain_generate(random_model_dir, context_window):
    """The role header run once for the batch (its keys/values shared) samples the same replies with the
    same log-probs as plain ``generate`` on the left-padded prompts, under each agent's own adapter."""
    team = make_team(random_model_dir, context_window=context_window, max_new_tokens=8)
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.3)
    private = ["x = 7", "", "x = 12345"]
    for agent, earlier in ((0, [[]] * 3), (1, [[("Reasoner", "hi")], [("Reasoner", "a longer reply here")], []])):
        prompt_ids, prompt_mask = team.encode_prompts(agent, HISTORIES, earlier, private if agent == 0 else None)
        adapter = team.agent_adapters[agent]
        torch.manual_seed(1)
        plain = team.sample(adapter, prompt_ids, prompt_mask)
        torch.manual_seed(1)
        shared = team.sample(adapter, prompt_ids, prompt_mask, agent)
        assert torch.equal(shared.response_ids, plain.response_ids) and torch.equal(shared.response_mask, plain.response_mask)
        torch.testing.assert_close(shared.logprobs, plain.logprobs, atol=1e-5, rtol=0)
        assert shared.settings == team.sampling == team.backend.settings
        assert shared.response_mask.sum(1).min() > 0 and len({tuple(r.tolist()) for r in shared.response_ids}) > 1  # real, different replies


class GreedyLoop:
    """A generation backend written against the interface alone: greedy decoding by full forwards, no cache."""

    def __init__(self, model, settings):
        self.model, self.settings = model, settings

    @torch.no_grad()
    def sample(self, prompt_ids, prompt_mask, agent=None):
        from marft.agents.generation import SampledReplies, reply_mask
        from marft.agents.headers import position_ids_from_mask

        s = self.settings
        ids, mask, steps, logprobs = prompt_ids, prompt_mask, [], []
        for _ in range(s.max_new_tokens):
            logits = self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits[:, -1]  # (B, V)
            logp = torch.log_softmax(s.scoring_logits(logits), -1)
            token = logp.argmax(-1, keepdim=True)  # (B, 1)
            steps.append(token)
            logprobs.append(logp.gather(-1, token))
            ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
        response_ids = torch.cat(steps, 1)  # (B, L)
        response_mask = reply_mask(response_ids, s.eos_id, s.max_new_tokens)
        return SampledReplies(response_ids, response_mask, torch.cat(logprobs, 1) * response_mask, s)


def test_a_backend_written_to_the_interface_replaces_generate(random_model_dir):
    """``team.backend`` is any object with ``settings`` and ``sample(prompt_ids, prompt_mask, agent)``: a whole team
    step runs on it, through each agent's own adapter, and its log-probs are the policy's."""
    team = make_team(random_model_dir)
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.3)
    team.backend = GreedyLoop(team.model, team.sampling)
    outs = play_step(team, HISTORIES, with_values=False)
    for agent, out in enumerate(outs):
        adapter = team.agent_adapters[agent]
        with torch.no_grad():
            scored = team.response_logprobs(adapter, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask).logprobs
            again = GreedyLoop(team.model, team.sampling).sample(out.prompt_ids, out.prompt_mask)  # routed to adapter by response_logprobs
        torch.testing.assert_close(out.logprobs, scored, atol=1e-5, rtol=0)
        assert torch.equal(again.response_ids, out.response_ids)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_decode_loop_samples_what_generate_samples(random_model_dir, temperature, top_k):
    """``--generation_backend decode_loop`` gives the ids of ``generate`` for the same seed, and log-probs equal to
    generate's (and to a scoring forward's), for agents with and without a role header, short and long histories."""
    from marft.agents.generation import DecodeLoop, TransformersGenerate

    torch.manual_seed(0)  # the adapters below do not depend on the tests run before
    team = make_team(random_model_dir, temperature=temperature, top_k=top_k, context_window=72)
    team.prompts.header_ids[0] = []  # agent 0 as an anonymous role: no header to share
    team.headers.header_ids[0] = []
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.3)
    prompt_ids, prompt_mask = team.encode_prompts(1, HISTORIES, [[]] * 3, None)
    team.bank.route(team.agent_adapters[1])
    sampled = team.backend.sample(prompt_ids, prompt_mask, 1).response_ids
    common = int(torch.mode(sampled[sampled != team.pad_id]).values)  # made a likely EOS below, so that replies end at different lengths
    with torch.no_grad():
        team.model.get_input_embeddings().weight[common] *= 30.0  # (tied to the output head)
    settings = dataclasses.replace(team.sampling, eos_id=common)
    loop, generate = DecodeLoop(team.headers, settings), TransformersGenerate(team.headers, settings)
    ended_early = 0
    for agent in range(team.n_agents):
        prompt_ids, prompt_mask = team.encode_prompts(agent, HISTORIES * 3, [[]] * 9, ["x = 7"] * 9 if agent == 1 else None)
        adapter = team.agent_adapters[agent]
        team.bank.route(adapter)
        torch.manual_seed(3)
        want = generate.sample(prompt_ids, prompt_mask, agent)
        torch.manual_seed(3)
        got = loop.sample(prompt_ids, prompt_mask, agent)
        assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.response_mask, want.response_mask)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
        with torch.no_grad():
            scored = team.response_logprobs(adapter, prompt_ids, prompt_mask, got.response_ids, got.response_mask).logprobs
        torch.testing.assert_close(got.logprobs, scored, atol=1e-5, rtol=1e-5)  # cached vs uncached forward: float32 rounding of log-probs ~ -10
        ended_early += int((got.response_mask.sum(1) < got.response_mask.shape[1]).sum())
    assert ended_early > 0  # some replies ended before the budget: the padding of finished rows is exercised


def test_reply_mask_stops_after_first_eos():
    eos = 7
    ids = torch.tensor([[1, 2, 7, 7, 7], [7, 7, 7, 7, 7], [1, 2, 3, 4, 5], [1, 7, 3, 0, 0]])
    mask = reply_mask(ids, eos, generated=5)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert reply_mask(ids, eos, generated=3)[2].tolist() == [1, 1, 1, 0, 0]


def test_empty_reply_is_scored(random_model_dir):
    """A reply that is only EOS decodes to "" and still gets a finite log-prob."""
    team = make_team(random_model_dir)
    prompt_ids, prompt_mask = team.encode_prompts(0, HISTORIES[:1], [[]])
    response_ids = torch.full((1, 6), team.pad_id)
    response_ids[0, 0] = team.eos_id
    response_mask = reply_mask(response_ids, team.eos_id, 6)
    with torch.no_grad():
        scores = team.response_logprobs("reasoner", prompt_ids, prompt_mask, response_ids, response_mask, with_entropy=True)
        logp = scores.logprobs
    assert torch.isfinite(logp).all() and logp[0, 0] < 0 and (logp[0, 1:] == 0).all()
    assert team.decode(response_ids, response_mask) == [""]


def test_long_history_is_cut_from_the_left_keeping_the_role_header(random_model_dir):
    team = make_team(random_model_dir)
    long_history = "Problem: What is 3 + 4?\n" + "Judge: wrong, try again\n" * 200
    ids, mask = team.encode_prompts(1, [long_history], [[("Reasoner", "3 + 4 = 7")]])
    assert ids.shape[1] == team.prompts.max_prompt_len
    header = team.prompts.header_ids[1]
    assert ids[0, : len(header)].tolist() == header
    text = team.tokenizer.decode(ids[0, len(header):])
    assert text.endswith("Reasoner: 3 + 4 = 7\nActor:")


def fill_buffer(team, n_envs=4, steps=2, trainer=None):
    """A real rollout from the team with random rewards, advantages computed by ``trainer``'s rule."""
    token_level = trainer is not None and trainer.token_level
    buffer = RolloutBuffer(steps, n_envs, team.n_agents, team.prompts.max_prompt_len, team.config.max_new_tokens, team.pad_id)
    histories = (HISTORIES * n_envs)[:n_envs]
    for t in range(steps):
        for agent, out in enumerate(play_step(team, histories, token_values=token_level)):
            buffer.insert_turn(t, agent, out)
        buffer.insert_step(t, torch.randint(0, 2, (n_envs, team.n_agents)).float(), torch.tensor([t == steps - 1] * n_envs), torch.zeros(n_envs, dtype=torch.bool))
    if trainer is None:
        fill_action_advantages(buffer, 0.99, 0.95)
    else:
        trainer.compute_advantages(buffer)
    return buffer


def snapshot(team):
    params = {n: p.detach().clone() for n, p in team.model.named_parameters()}
    params.update({f"value_head.{n}": p.detach().clone() for n, p in team.critic.value_head.named_parameters()})
    return params


def changed_groups(team, before):
    """Which parameter groups moved: adapter names, 'value_head' or 'base'."""
    after = snapshot(team)
    moved = set()
    for name, value in before.items():
        if not torch.equal(value, after[name]):
            if name.startswith("value_head."):
                moved.add("value_head")
            elif "lora_" in name:
                moved.add(name.split("lora_")[1].split(".")[1])
            else:
                moved.add("base")
    return moved


@pytest.mark.parametrize("algorithm", sorted(TRAINERS))
@pytest.mark.parametrize("shared_lora", [False, True])
def test_only_the_scheduled_agents_adapter_moves(random_model_dir, shared_lora, algorithm):
    torch.manual_seed(0)
    team = make_team(random_model_dir, shared_lora=shared_lora)
    # 4 env steps per iteration, switch every 8 env steps: the original MARFT's rule, agent (env steps // 8) % 2
    trainer = trainer_class(algorithm)(team, AlgoConfig(algorithm_name=algorithm, group_size=4, agent_iteration_interval=8, ppo_epoch=1, lr=1e-2), steps_per_iteration=4)
    for iteration, expected_agent in [(0, 0), (1, 1), (2, 1), (3, 0), (4, 0)]:
        assert trainer.agents_to_train(iteration) == [expected_agent]
        buffer = fill_buffer(team, trainer=trainer)
        before = snapshot(team)
        trainer.update(buffer, iteration)
        adapter = team.agent_adapters[expected_agent]
        critic = {"critic", "value_head"} if trainer.uses_critic else set()  # GRPO trains no critic
        assert changed_groups(team, before) == {adapter} | critic, iteration


def test_all_agents_train_when_interval_is_zero_and_none_during_warmup(random_model_dir):
    torch.manual_seed(0)
    team = make_team(random_model_dir)
    trainer = APPOTrainer(team, AlgoConfig(agent_iteration_interval=0, warmup_steps=8, ppo_epoch=1, lr=1e-2), steps_per_iteration=4)
    buffer = fill_buffer(team)
    before = snapshot(team)
    trainer.update(buffer, 0)
    assert changed_groups(team, before) == {"critic", "value_head"}
    before = snapshot(team)
    trainer.update(buffer, 1)
    assert changed_groups(team, before) == {"reasoner", "actor", "critic", "value_head"}


def test_policy_gradient_raises_the_logprob_of_advantaged_replies(random_model_dir):
    """One update must make replies with positive advantage more likely (sign check)."""
    torch.manual_seed(0)
    team = make_team(random_model_dir)
    trainer = APPOTrainer(team, AlgoConfig(ppo_epoch=4, lr=1e-2, normalize_advantages=False), steps_per_iteration=6)
    buffer = fill_buffer(team, n_envs=6, steps=1)
    buffer.advantages[:] = 0
    buffer.advantages[0, :3] = 1.0
    buffer.advantages[0, 3:] = -1.0
    trainer.update_policy("reasoner", buffer.agent_samples(0))
    s = buffer.agent_samples(0)
    with torch.no_grad():
        new = team.response_logprobs("reasoner", s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask).logprobs
    delta = new.sum(-1) - s.logprobs.sum(-1)
    assert (delta[:3] > 0).all() and (delta[3:] < 0).all()


def test_token_values_first_position_is_the_prompt_value(random_model_dir):
    torch.manual_seed(0)
    team = make_team(random_model_dir)
    out = play_step(team, HISTORIES, token_values=True)[0]
    with torch.no_grad():
        prompt_values = team.critic.values(out.prompt_ids, out.prompt_mask)
    torch.testing.assert_close(out.token_values[:, 0], prompt_values, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.values, prompt_values, atol=1e-5, rtol=0)
    assert (out.token_values[out.response_mask == 0] == 0).all()


def test_a_team_step_lets_each_agent_see_the_earlier_replies_and_values_every_turn(random_model_dir):
    team = make_team(random_model_dir, context_window=256)  # no history is cut
    private = [["x = 7", ""]] * len(HISTORIES)
    reasoner, actor = play_step(team, HISTORIES, private)
    for b, history in enumerate(HISTORIES):
        reasoner_text = team.tokenizer.decode(reasoner.prompt_ids[b][reasoner.prompt_mask[b].bool()])
        actor_text = team.tokenizer.decode(actor.prompt_ids[b][actor.prompt_mask[b].bool()])
        assert "x = 7" in reasoner_text and "x = 7" not in actor_text
        assert actor_text.endswith(f"{history}Reasoner: {reasoner.texts[b]}\nActor:")
    with torch.no_grad():
        for out in (reasoner, actor):
            torch.testing.assert_close(out.values, team.critic.values(out.prompt_ids, out.prompt_mask), atol=1e-5, rtol=0)
    evaluation = play_step(team, HISTORIES, private, with_values=False)
    assert all(out.values is None for out in evaluation)


@pytest.mark.parametrize(
    "profile,context_window",
    [("reasoner_actor", 256), ("reasoner_actor", 72), ("planner_solver_verifier", 256), ("reasoner_actor_anonymous", 256),
     (MIXED_PROFILE, 256)],
    ids=["two_agents", "history_cut", "three_agents", "anonymous", "one_header_missing"],
)  # 72: long histories are cut from the left; 3 agents: role headers of different lengths; anonymous: no headers
def test_critic_runs_each_role_header_once_and_values_as_the_plain_forward(random_model_dir, profile, context_window):
    """A team step's values (one forward for the role headers, one for every prompt behind them) equal one
    plain forward per prompt, for every agent, with private observations and trained (non-zero) adapters,
    so the shared keys/values must be the critic's and each row's own agent's."""
    torch.manual_seed(0)
    config = ModelConfig(model_name_or_path=random_model_dir, max_new_tokens=6, context_window=context_window)
    model, tokenizer = load_base_model(config)
    team = AgentTeam(model, tokenizer, load_profile(profile) if isinstance(profile, str) else profile, config)
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.3)
    private = [["x = 7"] + [""] * (team.n_agents - 1), [""] * team.n_agents, ["x = 12345"] + [""] * (team.n_agents - 1)]
    for token_level in (False, True):
        for agent, out in enumerate(play_step(team, HISTORIES, private, token_values=token_level)):
            with torch.no_grad():
                plain = team.critic.values(out.prompt_ids, out.prompt_mask)
                one_agent = team.critic.values(out.prompt_ids, out.prompt_mask, agent=agent)
                torch.testing.assert_close(out.values, plain, atol=1e-5, rtol=0)
                torch.testing.assert_close(one_agent, plain, atol=1e-5, rtol=0)
                if token_level:
                    plain_tokens = team.critic.token_values(out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
                    torch.testing.assert_close(out.token_values, plain_tokens, atol=1e-5, rtol=0)
            assert plain.std() > 0  # the prompts really differ
            other = agent - 1
            if team.prompts.header_ids[other] and team.prompts.header_ids[other] != team.prompts.header_ids[agent]:
                with pytest.raises(ValueError, match="role header"):
                    team.critic.values(out.prompt_ids, out.prompt_mask, agent=other)


def test_route_applies_the_same_adapter_as_peft_set_adapter(random_model_dir):
    """The fast adapter switch gives exactly the outputs of peft's ``set_adapter``, for every adapter, and
    leaves ``requires_grad`` as ``set_active`` left it."""
    team = make_team(random_model_dir)
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.3)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    team.set_active("actor", trainable=True)
    trainable = {n for n, p in team.model.named_parameters() if p.requires_grad}
    outputs = {}
    with torch.no_grad():
        for adapter in team.policy_adapters + ["critic", "reasoner"]:
            team.bank.route(adapter)
            routed = team.model(input_ids=ids).logits
            assert {n for n, p in team.model.named_parameters() if p.requires_grad} == trainable
            team.model.set_adapter(adapter)
            assert torch.equal(routed, team.model(input_ids=ids).logits)
            outputs[adapter] = routed
            team.set_active("actor", trainable=True)
    assert not torch.equal(outputs["reasoner"], outputs["actor"])  # the adapters really differ
    with pytest.raises(ValueError, match="no adapter"):
        team.bank.route("nobody")


def test_frozen_headers_reuse_role_headers_and_forbid_training(random_model_dir):
    """Inside ``headers.frozen()`` (a rollout) each adapter's role headers run once; the steps sample and value
    exactly as without it, and training an adapter there is refused (its cached headers would go stale)."""
    team = make_team(random_model_dir)
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.3)
    private = [["x = 7", ""]] * len(HISTORIES)
    torch.manual_seed(3)
    plain = [play_step(team, HISTORIES, private, token_values=True) for _ in range(2)]
    torch.manual_seed(3)
    with team.headers.frozen():
        frozen = [play_step(team, HISTORIES, private, token_values=True) for _ in range(2)]
        # (adapter, adapter folded into the base weights, (agent, shared opening) per header): the rollout runs merged
        # (--merge_lora_in_rollout)
        memo = sorted((adapter, merged, tuple(agent for agent, _ in headers)) for adapter, merged, headers in team.headers.memo)
        assert memo == [("actor", "actor", (1,)), ("critic", "critic", (0, 1)), ("reasoner", "reasoner", (0,))]
        with pytest.raises(RuntimeError, match="frozen"):
            team.set_active(team.agent_adapters[0], trainable=True)
    assert team.headers.memo is None
    for plain_step, frozen_step in zip(plain, frozen):
        for a, b in zip(plain_step, frozen_step):
            assert torch.equal(a.response_ids, b.response_ids) and a.texts == b.texts
            for field in ("logprobs", "values", "token_values"):
                torch.testing.assert_close(getattr(a, field), getattr(b, field), atol=1e-5, rtol=0)


def test_tppo_raises_the_logprob_of_advantaged_tokens(random_model_dir):
    """Token-level sign check: tokens with positive advantage become more likely, negative less."""
    torch.manual_seed(0)
    team = make_team(random_model_dir)
    trainer = TPPOTrainer(team, AlgoConfig(algorithm_name="TPPO", ppo_epoch=4, lr=1e-2, normalize_advantages=False), steps_per_iteration=6)
    buffer = fill_buffer(team, n_envs=6, steps=1, trainer=trainer)
    buffer.token_advantages[:] = 0
    buffer.token_advantages[0, :3, 0] = buffer.response_mask[0, :3, 0].float()
    buffer.token_advantages[0, 3:, 0] = -buffer.response_mask[0, 3:, 0].float()
    trainer.update_policy("reasoner", buffer.agent_samples(0, token_level=True))
    s = buffer.agent_samples(0, token_level=True)
    with torch.no_grad():
        new = team.response_logprobs("reasoner", s.prompt_ids, s.prompt_mask, s.response_ids, s.response_mask).logprobs
    delta = new.sum(-1) - s.logprobs.sum(-1)
    assert (delta[:3] > 0).all() and (delta[3:] < 0).all()


def test_one_base_model_whatever_the_team_size(random_model_dir):
    """Adding agents adds only their adapters: base parameters are stored once."""

    def sizes(profile_name, n_agents, shared=False):
        config = ModelConfig(model_name_or_path=random_model_dir, max_new_tokens=6, context_window=1024, shared_lora=shared)
        model, tokenizer = load_base_model(config)
        team = AgentTeam(model, tokenizer, load_profile(profile_name, n_agents=n_agents), config)
        base = sum(p.numel() for n, p in team.model.named_parameters() if "lora_" not in n)
        adapter = sum(p.numel() for n, p in team.model.named_parameters() if "lora_" in n)
        return base, adapter, len(team.adapter_parameters(team.agent_adapters[0]))

    base2, adapters2, per_agent = sizes("reasoner_actor", 2)
    base4, adapters4, _ = sizes("planner_solver_reflector_verifier", 4)
    base4_shared, adapters4_shared, _ = sizes("planner_solver_reflector_verifier", 4, shared=True)
    assert base2 == base4 == base4_shared
    assert adapters4 * 3 == adapters2 * 5  # 2 agents + critic = 3 adapters; 4 agents + critic = 5
    assert adapters4_shared * 3 == adapters2 * 2  # one shared adapter + critic
    assert per_agent > 0


def test_sampling_with_the_adapter_folded_into_the_base_weights(random_model_dir):
    """``--merge_lora_in_rollout``: inside ``bank.merged(adapter)`` the forward equals the unmerged LoRA forward
    (float32 rounding), replies sampled merged are those sampled unmerged for a seed, with the same log-probs, and on
    exit every base weight is the very tensor it was (bit for bit) with the LoRA branches back on."""
    torch.manual_seed(0)
    team = make_team(random_model_dir, max_new_tokens=8)
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_" in name:
                p.normal_(std=0.3)
    base_before = {n: p.detach().clone() for n, p in team.model.named_parameters() if "lora_" not in n}
    ids, mask = team.encode_prompts(1, HISTORIES, [[("Reasoner", "hi")], [], []])
    for adapter in team.agent_adapters:
        team.bank.route(adapter)
        with torch.no_grad():
            unmerged = team.model(input_ids=ids, attention_mask=mask).logits
            with team.bank.merged(adapter):
                assert team.bank.merged_adapter == adapter
                merged = team.model(input_ids=ids, attention_mask=mask).logits
                with pytest.raises(RuntimeError):
                    with team.bank.merged(adapter):
                        pass
            team.model.double()  # the same function in float64 (float32 -> float64 -> float32 is exact)
            exact = team.model(input_ids=ids, attention_mask=mask).logits
            team.model.float()
        assert not torch.equal(merged, unmerged)  # a different computation ...
        merged_error, unmerged_error = (merged.double() - exact).abs().max(), (unmerged.double() - exact).abs().max()
        # ... of the same function, to float32 rounding (logits ~0.7 here; which of the two rounds closer to the float64
        # computation depends on the CPU's kernels: 8x either way between an AMD EPYC and an Intel Xeon)
        assert merged_error < 1e-4 and unmerged_error < 1e-4
        with torch.no_grad():
            with team.bank.reference_policy():
                base_logits = team.model(input_ids=ids, attention_mask=mask).logits
        assert (base_logits - unmerged).abs().max() > 1e-2  # the adapters matter here
    for n, p in team.model.named_parameters():
        if n in base_before:
            assert torch.equal(p, base_before[n]), n  # restored bit for bit
    assert team.bank.merged_adapter is None and not any(layer.disable_adapters for layer in team.bank.lora_layers)

    off = make_team(random_model_dir, max_new_tokens=8, merge_lora_in_rollout=False)
    off.model.load_state_dict(team.model.state_dict())
    for agent, adapter in enumerate(team.agent_adapters):
        ids, mask = team.encode_prompts(agent, HISTORIES * 2, [[]] * 6)
        torch.manual_seed(5)
        got = team.sample(adapter, ids, mask, agent)
        torch.manual_seed(5)
        want = off.sample(adapter, ids, mask, agent)
        assert torch.equal(got.response_ids, want.response_ids)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=0)  # float32 rounding of logits ~3e-5 (above)

    merged_outs, plain_outs = play_step_with_values(team), play_step_with_values(off)
    for got, want in zip(merged_outs, plain_outs):  # a whole team step: the same replies, log-probs and critic values
        assert torch.equal(got.response_ids, want.response_ids)
        torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-4, rtol=0)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)  # values ~3: float32 rounding
        torch.testing.assert_close(got.token_values, want.token_values, atol=1e-5, rtol=1e-4)
        assert got.values.abs().max() > 1e-3


def play_step_with_values(team):
    with torch.no_grad():
        for head in team.critic.value_heads.values():
            torch.manual_seed(2)
            head.weight.normal_()  # values of a real size
    torch.manual_seed(6)
    return play_step(team, HISTORIES, token_values=True)


def test_half_precision_adapters_are_not_merged(random_model_dir):
    """In bfloat16, W + ΔW would round the small LoRA update away: the team samples unmerged there."""
    team = make_team(random_model_dir, dtype="bfloat16")
    assert not team.bank.can_merge(team.agent_adapters[0])
    with pytest.raises(ValueError):
        with team.bank.merged(team.agent_adapters[0]):
            pass
    ids, mask = team.encode_prompts(0, HISTORIES, [[]] * 3)
    assert team.sample(team.agent_adapters[0], ids, mask, 0).response_ids.shape == (3, team.config.max_new_tokens)


@pytest.mark.parametrize("one_batch", [True, False], ids=["one_batch", "batch_per_adapter"])
def test_rows_sampled_by_other_adapters_come_back_in_order_as_each_adapters_own_batch(random_model_dir, one_batch):
    """``act(..., adapters=...)`` (an opponent pool's snapshot per game): each row is sampled by its adapter, the rows of
    one adapter as one batch, and the replies come back in the rows' order: greedy replies and log-probs equal those of
    each adapter's rows played on their own."""
    team = make_team(random_model_dir)
    team.bank.add_frozen_copies({team.agent_adapters[0]: "snapshot"})
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if ".snapshot." in name and "lora_B" in name:
                p.normal_(0.0, 0.5)  # another policy
    team.set_top_k(1)
    assert team.mixes_adapter_rows()  # the default, where the backend and the adapters can
    team.mix_adapters = one_batch
    histories = HISTORIES * 2
    adapters = ["snapshot", team.agent_adapters[0], team.agent_adapters[0], "snapshot", team.agent_adapters[0], "snapshot"]
    calls, sample_rows = [], team.backend.sample_rows
    team.backend.sample_rows = lambda *args, **kwargs: calls.append(args[3] if len(args) > 3 else kwargs.get("adapters")) or sample_rows(*args, **kwargs)
    mixed = team.act(0, histories, [[]] * 6, adapters=adapters)
    if one_batch:  # each row through its adapter
        assert len(calls) == 1 and calls[0].names == ["snapshot", team.agent_adapters[0]]
    else:
        assert calls == [None, None]
    assert team.bank.active == team.agent_adapters[0]  # the header runs routed each adapter in turn, then back
    team.backend.sample_rows = sample_rows
    for name in set(adapters):
        rows = [r for r, a in enumerate(adapters) if a == name]
        alone = team.act(0, [histories[r] for r in rows], [[]] * len(rows), adapters=[name] * len(rows))
        assert [mixed.texts[r] for r in rows] == alone.texts
        assert torch.equal(mixed.response_ids[rows], alone.response_ids)
        torch.testing.assert_close(mixed.logprobs[rows], alone.logprobs, atol=1e-5, rtol=0)
    own = team.act(0, histories, [[]] * 6)
    assert any(own.texts[r] != mixed.texts[r] for r, a in enumerate(adapters) if a == "snapshot"), "the snapshot must play otherwise"
    with pytest.raises(ValueError, match="2 adapters for 6 rows"):
        team.act(0, histories, [[]] * 6, adapters=["snapshot"] * 2)


@pytest.mark.parametrize("backend", ["decode_loop_header_only_prompt", "generate"])
def test_rows_of_several_adapters_in_the_edge_cases_reply_as_each_adapters_own_batch(random_model_dir, backend):
    """Rows of several adapters give each adapter's own greedy replies where a shared header cannot serve (decode_loop,
    a prompt that is only its role header: that adapter's prompts run whole) and where the backend cannot mix them
    (transformers' generate: a batch per adapter)."""
    team = make_team(random_model_dir, generation_backend="generate" if backend == "generate" else "decode_loop")
    team.bank.add_frozen_copies({team.agent_adapters[0]: "snapshot"})
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if ".snapshot." in name and "lora_B" in name:
                p.normal_(0.0, 0.5)
    team.set_top_k(1)
    adapters = ["snapshot", team.agent_adapters[0], "snapshot"]
    if backend == "decode_loop_header_only_prompt":
        from marft.agents.unpadded import RowAdapters

        ids, mask = team.encode_prompts(0, HISTORIES, [[]] * 3)
        rows = RowAdapters(["snapshot", team.agent_adapters[0]], torch.tensor([0, 1, 0]))
        header = team.headers.header_ids[0]
        ids, mask = ids.clone(), mask.clone()
        ids[1], mask[1] = team.pad_id, 0
        ids[1, -len(header):], mask[1, -len(header):] = torch.tensor(header), 1  # row 1's prompt: its header alone
        by_adapter = team.backend.sample(ids, mask, 0, adapters=rows)
        for name, picked in rows.rows.items():
            team.bank.route(name)
            alone = team.backend.sample(ids[picked], mask[picked], 0)
            assert torch.equal(by_adapter.response_ids[picked], alone.response_ids)
        return
    mixed = team.act(0, HISTORIES, [[]] * 3, adapters=adapters)
    for name in set(adapters):
        rows = [r for r, a in enumerate(adapters) if a == name]
        alone = team.act(0, [HISTORIES[r] for r in rows], [[]] * len(rows), adapters=[name] * len(rows))
        assert torch.equal(mixed.response_ids[rows], alone.response_ids)


@pytest.mark.parametrize("profile", ["reasoner_actor", "mixed", "shared_lora"])
def test_agents_of_one_moment_sample_in_one_batch_as_each_agent_alone(random_model_dir, profile):
    """``act_together``: two agents' rows (each behind its own role header, or none, through its own adapter) sampled
    as one batch: the same greedy replies and log-probs (float32 rounding) as each agent's ``act``, in one call."""
    from marft.types import AgentTurns

    config = ModelConfig(model_name_or_path=random_model_dir, max_new_tokens=6, context_window=96, shared_lora=profile == "shared_lora")
    model, tokenizer = load_base_model(config)
    team = AgentTeam(model, tokenizer, MIXED_PROFILE if profile == "mixed" else load_profile("reasoner_actor", n_agents=2), config)
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)  # each agent its own policy
    team.set_top_k(1)
    turns = [AgentTurns(0, HISTORIES[:2], [[], []]), AgentTurns(1, HISTORIES, [[("Reasoner", "hi")], [], [("Reasoner", "a longer reply")]])]
    calls, sample_rows = [], team.backend.sample_rows
    team.backend.sample_rows = lambda *args, **kwargs: calls.append(args) or sample_rows(*args, **kwargs)
    together = team.act_together(turns)
    team.backend.sample_rows = sample_rows
    assert len(calls) == 1 and calls[0][2].tolist() == [0, 0, 1, 1, 1]  # one batch, each row's agent
    for turn, out in zip(turns, together):
        alone = team.act(turn.agent, turn.histories, turn.earlier_turns)
        assert out.texts == alone.texts and torch.equal(out.response_ids, alone.response_ids)
        assert torch.equal(out.prompt_ids, alone.prompt_ids) and torch.equal(out.prompt_mask, alone.prompt_mask)
        torch.testing.assert_close(out.logprobs, alone.logprobs, atol=1e-5, rtol=0)
    if profile != "shared_lora":  # the agents reply otherwise: the check is not vacuous
        assert together[0].texts != team.act(1, HISTORIES[:2], [[], []]).texts
    team.mix_adapters = False  # one batch per agent: act for each
    assert [o.texts for o in team.act_together(turns)] == [o.texts for o in together]


def test_agents_of_one_moment_in_one_batch_on_a_half_precision_model(random_model_dir):
    """bfloat16 weights under float32 adapters: the moment's agents still share one batch, and their replies are scored
    with a forward under each row's adapter (half precision samples no log-probs)."""
    from marft.types import AgentTurns

    team = make_team(random_model_dir, dtype="bfloat16")
    assert team.mixes_adapter_rows()
    turns = [AgentTurns(0, HISTORIES[:2], [[], []]), AgentTurns(1, HISTORIES, [[("Reasoner", "hi")], [], []])]
    together = team.act_together(turns)
    for turn, out in zip(turns, together):
        assert out.response_ids.shape == (len(turn.histories), team.config.max_new_tokens) and len(out.texts) == len(turn.histories)
        rescored = team.response_logprobs(team.agent_adapters[turn.agent], out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask,
                                          agents=torch.full((len(turn.histories),), turn.agent)).logprobs
        assert torch.isfinite(out.logprobs).all() and torch.equal(out.logprobs, rescored)
