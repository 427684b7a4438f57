"""The update runs each role header once per minibatch chunk and shares its keys/values with every row of
that agent, the gradient flowing back through them: gradients equal the plain per-row forward's."""

import pytest
import torch
from team_oracle import play_step
from test_rl_audit import one_step_gradients, perturb_adapters
from test_team import HISTORIES

from marft.agents.team import AgentTeam
from marft.algorithms import batching, trainer_class
from marft.config import AlgoConfig, ModelConfig
from marft.envs.profile import load_profile
from marft.models.loading import load_base_model
from marft.runner.shared.buffer import RolloutBuffer

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 2


def rollout(model_dir, algorithm, profile="planner_solver_verifier", context_window=256, algo=None, **model):
    """A team (trained, non-zero adapters), its trainer, and a buffer of real turns with private observations and
    random advantages and returns (the gradients are compared, not the estimators)."""
    torch.manual_seed(0)
    config = ModelConfig(model_name_or_path=model_dir, max_new_tokens=6, context_window=context_window, **model)
    base, tokenizer = load_base_model(config)
    cls = trainer_class(algorithm)
    team = AgentTeam(base, tokenizer, load_profile(profile), config, with_critic=cls.uses_critic)
    perturb_adapters(team, std=0.3)
    # max_update_kl None: these tests count an update's header forwards, and the bound's measuring forward
    # (tests/algorithms/test_update_kl_bound.py) would add its own
    trainer = cls(team, AlgoConfig(algorithm_name=algorithm, ppo_epoch=1, **{"max_update_kl": None, **(algo or {})}),
                  steps_per_iteration=len(HISTORIES))
    N, E = team.n_agents, len(HISTORIES)
    private = [["x = 7"] + [""] * (N - 1), [""] * N, ["x = 12345"] + [""] * (N - 1)]
    buffer = RolloutBuffer(STEPS, E, N, team.prompts.max_prompt_len, config.max_new_tokens, team.pad_id)
    for t in range(STEPS):
        for agent, out in enumerate(play_step(team, HISTORIES, private, with_values=cls.uses_critic, token_values=cls.token_level)):
            buffer.insert_turn(t, agent, out)
        buffer.insert_step(t, torch.randint(0, 2, (E, N)).float(), torch.full((E,), t == STEPS - 1), torch.zeros(E, dtype=torch.bool))
    for name in ("advantages", "returns", "token_advantages", "token_returns"):
        setattr(buffer, name, torch.randn_like(getattr(buffer, name)))
    return team, trainer, buffer


def gradients(team, trainer, buffer, shared: bool, monkeypatch, every_layer_at_once: bool = False) -> tuple[list[list[torch.Tensor]], int]:
    """First-step gradients of every policy adapter's update and of every critic's, with the role headers shared
    (or each row running its own header, the plain forward), and how many header forwards ran.
    ``every_layer_at_once``: the rows' header keys/values formed for every layer before the forward (a
    transformers cache) instead of layer by layer (``HeaderRows``)."""
    runs = []
    with monkeypatch.context() as patch:
        original = team.headers.forward_headers
        patch.setattr(team.headers, "forward_headers", lambda ids, mask: runs.append(len(ids)) or original(ids, mask))
        if not shared:
            patch.setattr(team.headers, "rows_behind_headers", lambda agents, ids, mask, by_layer=False: (None, ids, mask))
        elif every_layer_at_once:
            behind = team.headers.rows_behind_headers
            patch.setattr(team.headers, "rows_behind_headers", lambda agents, ids, mask, by_layer=False: behind(agents, ids, mask))
        results = []
        with team.bank.lora_dropout_active():
            for adapter, agents in trainer.adapter_groups(list(range(team.n_agents))).items():
                torch.manual_seed(1)
                results.append(one_step_gradients(trainer, trainer.update_policy, adapter, buffer.agent_samples(agents, trainer.token_level)))
            for critic in team.critic_adapters:
                torch.manual_seed(1)
                samples = buffer.critic_samples(trainer.token_level, team.critic.agents_of(critic))
                results.append(one_step_gradients(trainer, trainer.update_critic, samples, critic))
        team.set_active(None)
    return results, len(runs)


def assert_same_gradients(shared, plain):
    assert len(shared) == len(plain) > 0
    for ours, theirs in zip(shared, plain):
        assert len(ours) == len(theirs) > 0 and any(g.abs().sum() > 0 for g in theirs)
        for a, b in zip(ours, theirs):
            torch.testing.assert_close(a, b, atol=1e-4 * float(b.abs().max()), rtol=0)  # float32 sums in another order: 1e-6..3e-5 of the scale


@pytest.mark.parametrize(
    "algorithm,context_window,model,algo",
    [
        ("APPO", 256, {}, {}),
        ("APPO", 120, {}, {"entropy_coef": 0.01, "kl_coef": 0.1}),  # 120: histories cut from the left; entropy in the loss
        ("TPPO", 256, {"critic_mode": "per_agent"}, {"gradient_cp_steps": 2}),
        ("TPPO", 120, {"shared_lora": True}, {"entropy_coef": 0.01}),  # one adapter: rows of three agents behind three headers
        ("GRPO", 256, {}, {"normalization_mode": "token", "kl_coef": 0.1}),
        ("APPO", 256, {"share_prompt_openings": True}, {"gradient_cp_steps": 2}),  # openings the rows share, too
    ],
    ids=["appo", "appo_history_cut_entropy_kl", "tppo_per_agent_critics_two_chunks", "tppo_shared_lora_history_cut", "grpo_kl",
         "appo_shared_openings_two_chunks"],
)
def test_update_with_shared_role_headers_has_the_plain_forwards_gradients(random_model_dir, monkeypatch, algorithm, context_window, model, algo):
    """Policy (with entropy and reference-KL terms) and critic gradients with each header run once per minibatch equal
    those of one plain forward per row (within 1e-4 of each gradient's largest entry; measured 1e-6 to 3e-5), for three agents with headers of different lengths,
    private observations and histories cut from the left; and the headers really ran once per chunk."""
    team, trainer, buffer = rollout(random_model_dir, algorithm, context_window=context_window, algo=algo, **model)
    full = buffer.prompt_mask.sum(-1) == team.prompts.max_prompt_len  # (T, E, S) prompts at the budget: their history was cut
    assert full.any() == (context_window < 256)
    plain, plain_runs = gradients(team, trainer, buffer, shared=False, monkeypatch=monkeypatch)
    shared, shared_runs = gradients(team, trainer, buffer, shared=True, monkeypatch=monkeypatch)
    assert_same_gradients(shared, plain)
    assert plain_runs == 0
    chunks = trainer.config.gradient_cp_steps
    # with the gradient, one header forward per adapter, minibatch and set of agents in a chunk (chunks of the same
    # agents share it); without (the reference policy's scoring), one per chunk
    groups, reference = len(trainer.adapter_groups(list(range(team.n_agents)))), chunks if trainer.config.effective_kl_coef else 0
    per_chunk = groups * (chunks + reference) + sum(chunks * len(team.critic.agents_of(c)) for c in team.critic_adapters)
    assert groups * (1 + reference) + len(team.critic_adapters) <= shared_runs <= per_chunk


@pytest.mark.parametrize("algorithm,model", [("APPO", {}), ("TPPO", {"shared_lora": True})], ids=["appo", "tppo_shared_lora"])
def test_header_rows_formed_layer_by_layer_change_nothing(random_model_dir, monkeypatch, algorithm, model):
    """The rows' copies of the role headers' keys/values formed one layer at a time (``HeaderRows``: the memory of
    B x C columns for one layer, not for the whole model) give bit-identical gradients of every policy and critic,
    and bit-identical rollout values, to forming them for every layer first."""
    from marft.agents.headers import HeaderRows

    team, trainer, buffer = rollout(random_model_dir, algorithm, **model)
    at_once, _ = gradients(team, trainer, buffer, shared=True, monkeypatch=monkeypatch, every_layer_at_once=True)
    formed = []
    with monkeypatch.context() as patch:
        keys_values = HeaderRows.keys_values
        patch.setattr(HeaderRows, "keys_values", lambda rows, index: formed.append(index) or keys_values(rows, index))
        by_layer, _ = gradients(team, trainer, buffer, shared=True, monkeypatch=monkeypatch)
    assert formed and set(formed) == set(range(team.model.config.num_hidden_layers))
    assert len(by_layer) == len(at_once) > 0
    for ours, theirs in zip(by_layer, at_once):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    samples = buffer.critic_samples()
    batches = [(agent, samples.prompt_ids[samples.agent == agent], samples.prompt_mask[samples.agent == agent]) for agent in range(team.n_agents)]
    with torch.no_grad():
        team.headers.bank.route(team.critic.adapter_for(0))
        states = [team.headers.decoder_states(*team.headers.behind_headers(batches, by_layer=by_layer), tail=1) for by_layer in (True, False)]
    assert torch.equal(*states)


def test_gradient_checkpointing_falls_back_to_the_plain_forward(random_model_dir, monkeypatch):
    """transformers drops a given cache in checkpointed layers, so under --gradient_checkpointing the update does not
    share headers (no header forward runs) and its gradients are still the plain forward's."""
    team, trainer, buffer = rollout(random_model_dir, "APPO", gradient_checkpointing=True)
    plain, _ = gradients(team, trainer, buffer, shared=False, monkeypatch=monkeypatch)
    shared, runs = gradients(team, trainer, buffer, shared=True, monkeypatch=monkeypatch)
    assert runs == 0
    assert_same_gradients(shared, plain)


def test_rows_of_several_agents_keep_their_order_behind_their_headers(random_model_dir):
    """Rows of three agents in any order: each row behind its own agent's header gives the plain forward's
    last hidden state, in the rows' own order."""
    team, _, buffer = rollout(random_model_dir, "APPO")
    samples = buffer.critic_samples()
    order = torch.randperm(len(samples.agent))
    agents, ids, mask = samples.agent[order], samples.prompt_ids[order], samples.prompt_mask[order]
    assert len(set(agents.tolist())) == 3
    with torch.no_grad():
        torch.testing.assert_close(team.critic.values(ids, mask, agent=agents), team.critic.values(ids, mask), atol=1e-5, rtol=0)


def test_rows_are_picked_reproducibly_under_autograd():
    """``select_rows`` gives each row its header's keys/values exactly, and under autograd sums the rows' gradients
    into the header in a fixed order: two identical backward passes on two threads give bit-identical gradients
    (an index's backward adds with atomic adds on CPU, in a varying order)."""
    from transformers import DynamicCache

    from marft.agents.headers import select_rows

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        keys = torch.randn(2, 4, 96, 32, requires_grad=True)  # (n headers, heads, header length, head dim)
        values = torch.randn(2, 4, 96, 32, requires_grad=True)
        rows = torch.randint(0, 2, (64,))
        weights = torch.randn(64, 4, 96, 32)
        grads = []
        for _ in range(3):
            cache = DynamicCache()
            cache.update(keys * 1.0, values * 1.0, 0)
            select_rows(cache, rows)
            layer = cache.layers[0]
            assert torch.equal(layer.keys, keys[rows]) and torch.equal(layer.values, values[rows])
            ((layer.keys * weights).sum() + (layer.values * weights).sum()).backward()
            grads.append((keys.grad.clone(), values.grad.clone()))
            keys.grad = values.grad = None
        assert all(torch.equal(g[0], grads[0][0]) and torch.equal(g[1], grads[0][1]) for g in grads)
        torch.testing.assert_close(grads[0][0], torch.zeros_like(keys).index_add_(0, rows, weights))  # each header: its rows' sum
    finally:
        torch.set_num_threads(threads)


def test_chunks_of_a_minibatch_share_one_header_forward(random_model_dir, monkeypatch):
    """Minibatches cut into chunks that each hold rows of all three agents (the policy's into 2, the critic's into
    2 x 3): one header forward (and backward) per adapter for all of a minibatch's chunks, with the plain forward's
    gradients."""
    team, trainer, buffer = rollout(random_model_dir, "APPO", shared_lora=True, algo={"gradient_cp_steps": 2, "kl_coef": 0.0})  # no reference forward to count
    plain, _ = gradients(team, trainer, buffer, shared=False, monkeypatch=monkeypatch)
    monkeypatch.setattr(trainer, "_minibatches", _same_agents_in_every_chunk(trainer._minibatches, buffer))
    shared, runs = gradients(team, trainer, buffer, shared=True, monkeypatch=monkeypatch)
    assert runs == 2  # the shared policy adapter and the critic: one each
    assert_same_gradients(shared, plain)


def _same_agents_in_every_chunk(minibatches, buffer):
    """``trainer._minibatches`` whose chunks each hold rows of every agent (round-robin over the agents' rows)."""
    def wrapped(samples, chunks_per_minibatch):
        out = []
        for minibatch in minibatches(samples, chunks_per_minibatch):
            rows = torch.cat(minibatch.chunks)
            by_agent = [rows[samples.agent[rows] == a] for a in samples.agent.unique()]
            interleaved = torch.stack([r[: min(len(x) for x in by_agent)] for r in by_agent], 1).flatten()
            out.append(minibatch._replace(chunks=list(interleaved.chunk(chunks_per_minibatch))))
        return out
    return wrapped


def test_with_a_chunk_token_budget_every_chunk_runs_its_own_headers(random_model_dir, monkeypatch):
    """``--max_chunk_tokens`` bounds what a chunk holds: the critic's chunks (rows of three agents behind their
    headers) each run their own role headers, so no header's graph outlives its chunk (held over a minibatch, a
    critic of n agents would hold n headers' activations), with the gradient of the shared forward."""
    team, trainer, buffer = rollout(random_model_dir, "APPO", algo={"kl_coef": 0.0})  # no reference forward to count
    shared, shared_runs = gradients(team, trainer, buffer, shared=True, monkeypatch=monkeypatch)
    widest = buffer.prompt_mask.sum(-1).max() + buffer.response_mask.sum(-1).max() + max(map(len, team.headers.header_ids))
    budget = int(widest)  # about a row a chunk
    trainer.config = AlgoConfig(algorithm_name="APPO", ppo_epoch=1, max_chunk_tokens=budget, kl_coef=0.0, max_update_kl=None)
    seen = []
    minibatches = trainer._minibatches
    monkeypatch.setattr(trainer, "_minibatches", lambda s, k: [m for m in minibatches(s, k) if not seen.append(m)])
    per_chunk, per_chunk_runs = gradients(team, trainer, buffer, shared=True, monkeypatch=monkeypatch)
    assert all(m.budget_cut for m in seen)  # every minibatch here is cut (none runs as without a budget)
    assert per_chunk_runs == sum(len(m.chunks) for m in seen) > shared_runs  # one header forward per chunk (policies' and critic's)
    assert_same_gradients(per_chunk, shared)


def test_headers_held_over_an_uncut_minibatch_count_against_the_budget(random_model_dir):
    """The critic's chunks (one per agent) each fit the budget, but run with shared headers every chunk's header
    graph is held until the minibatch ends: when the largest chunk plus all held headers pass the budget, the
    minibatch keeps its chunks and runs each one's own headers (``budget_cut``); with room for them, it runs as
    without a budget."""
    team, trainer, buffer = rollout(random_model_dir, "APPO", algo={"kl_coef": 0.0})
    samples = buffer.critic_samples(False)
    trainer.config = AlgoConfig(algorithm_name="APPO", ppo_epoch=1, max_chunk_mib=0, kl_coef=0.0, max_update_kl=None)
    torch.manual_seed(0)
    (plain,) = trainer._minibatches(samples, team.n_agents)
    header_lengths = batching.header_lengths(samples, trainer.team.headers)
    rows, headers = zip(*(batching.chunk_positions(samples, chunk, header_lengths) for chunk in plain.chunks))
    assert len(plain.chunks) == team.n_agents and min(headers) > 0 and not plain.budget_cut
    fits_alone = max(r + h for r, h in zip(rows, headers))  # no chunk is cut at this budget
    assert fits_alone < max(rows) + sum(headers)
    for budget, cut in ((fits_alone, True), (max(rows) + sum(headers), False)):
        trainer.config = AlgoConfig(algorithm_name="APPO", ppo_epoch=1, max_chunk_tokens=budget, kl_coef=0.0, max_update_kl=None)
        torch.manual_seed(0)
        (minibatch,) = trainer._minibatches(samples, team.n_agents)
        assert [c.tolist() for c in minibatch.chunks] == [c.tolist() for c in plain.chunks] and minibatch.budget_cut is cut
