"""Workflows: graph layers in parallel, the orchestrator's protocol, bad workflow input, the turn buffer's GAE
against a per-env walk, the sequential core against the fixed-order reference, and orchestrated runs."""

from __future__ import annotations

import json

import pytest
import torch
from team_oracle import play_step

from marft.algorithms.advantages import agent_chain_gae
from marft.config import AlgoConfig, EnvConfig, ModelConfig, RunnerConfig, TrainConfig
from marft.envs import MultiAgentTextEnv, StepOutcome
from marft.envs.profile import PROFILE_DIR, load_profile
from marft.envs.workflows import workflow_for

pytestmark = pytest.mark.usefixtures("one_thread")


class EchoEnv(MultiAgentTextEnv):
    """Any team; the reward is 1 when the graded reply (the last answering agent's) says "ok"."""

    def __init__(self, profile):
        self.profile = profile
        super().__init__([s.role for s in profile])
        self.set_workflow(workflow_for(profile))

    def sample_task(self, options):
        return {"problem": "p", "answer": "ok"}

    def evaluate(self, state, actions):
        graded = max(n for n, s in enumerate(self.profile) if s.with_answer)
        ok = float(actions[graded] == "ok")
        return StepOutcome(rewards=(ok,) * self.n_agents, solved=bool(ok))


# ---------------------------------------------------------------------- graphs
def test_a_graph_layer_speaks_in_parallel_and_the_verifier_reads_both_in_graph_order():
    env = EchoEnv(load_profile("solvers_verifier_graph"))
    env.reset(seed=0)
    assert env.speakers() == [0, 1]  # Solver A and Solver B together
    seen_by_b = env.visible_turns(1)
    env.take_turn(1, "b says 2")  # B finishes first ...
    assert env.visible_turns(0) == seen_by_b == []  # ... and A still sees the history B saw
    env.take_turn(0, "a says 1")
    assert env.speakers() == [2]
    assert env.visible_turns(2) == [("Solver A", "a says 1"), ("Solver B", "b says 2")]  # graph order, not finishing order
    with pytest.raises(ValueError, match="not due"):
        env.take_turn(0, "again")
    env.take_turn(2, "ok")
    obs, rewards, terminated, _, _ = env.step(env.turn_actions())
    assert obs.endswith("Solver A: a says 1\nSolver B: b says 2\nVerifier: ok\n") and terminated and rewards.tolist() == [1.0] * 3


def test_the_sequential_workflow_is_the_profile_order_and_step_takes_whole_teams_as_before():
    env = EchoEnv(load_profile("planner_solver_verifier"))
    env.reset(seed=0)
    for agent in range(3):
        assert env.speakers() == [agent]
        env.take_turn(agent, "ok" if agent == 2 else f"r{agent}")
    by_turns = env.step(env.turn_actions())[0]
    env.reset(seed=0)
    assert env.step(("r0", "r1", "ok"))[0] == by_turns  # the whole team's replies at once: the same history


# ---------------------------------------------------------------------- orchestrator
@pytest.fixture
def orchestrated():
    profile = load_profile("planner_solver_verifier_orchestrated")
    env = EchoEnv(profile)
    env.set_workflow(workflow_for(profile, "orchestrated", max_turns=2))
    env.reset(seed=0)
    return env


def test_the_orchestrator_calls_a_specialist_with_a_handover_and_done_ends_the_step(orchestrated):
    env = orchestrated
    assert env.speakers() == [3]
    env.take_turn(3, "We need a solution. <call>Solver</call>")
    assert env.speakers() == [1]
    assert env.visible_turns(1)[-1] == ("Host", "Now it is Solver's turn.")
    env.take_turn(1, "ok")
    assert env.speakers() == [3]  # handed back
    env.take_turn(3, "<call>Planner</call> but really <done/>")  # <done/> wins over a call
    assert env.speakers() == [] and not env.turns.invalid and env.turns.calls == [1]
    assert env.turn_actions() == ("", "ok", "ok", "<call>Planner</call> but really <done/>")  # the team's answer also sits in the graded (Verifier's) slot
    obs, rewards, *_ = env.step(env.turn_actions())
    assert "Orchestrator: We need a solution. <call>Solver</call>\nHost: Now it is Solver's turn.\nSolver: ok\n" in obs
    assert rewards.tolist() == [1.0] * 4


@pytest.mark.parametrize("reply", ["no tag at all", "<call>Judge</call>", "<call></call>", ""])
def test_an_unknown_role_or_no_tag_ends_the_step_with_the_current_answer_and_is_counted(orchestrated, reply):
    env = orchestrated
    env.take_turn(3, reply)
    assert env.speakers() == [] and env.turns.invalid
    assert env.turn_actions()[2] == ""  # nobody answered yet


def test_max_turns_bounds_the_specialist_calls(orchestrated):
    env = orchestrated  # max_turns=2
    for specialist, role in ((0, "Planner"), (2, "Verifier")):
        env.take_turn(3, f"<call>{role}</call>")
        env.take_turn(specialist, f"{role} speaks")
    assert env.speakers() == [] and env.turns.calls == [0, 2]  # graded after the second call, no third orchestrator turn
    assert env.turn_actions()[2] == "Verifier speaks"


@pytest.mark.parametrize("entries, message", [
    ({"agents": [{"role": "A", "with_answer": True}, {"role": "B"}], "graph": {"edges": [["A", "B"], ["B", "A"]]}}, "has a cycle"),
    ({"agents": [{"role": "A", "with_answer": True}], "graph": {"edges": [["A", "Z"]]}}, "unknown role 'Z'"),
    ({"agents": [{"role": "A", "with_answer": True}], "orchestrator": {"role": "O", "prompt": "Lead the team."}}, "names no specialist"),
    ({"agents": [{"role": "A", "with_answer": True}], "orchestrator": {"role": "Host", "prompt": "{specialists}"}}, "reserved role 'Host'"),
    ({"agents": [{"role": "A", "with_answer": True}], "graph": {}, "orchestrator": {"role": "O", "prompt": "A"}}, "not both"),
])
def test_bad_workflow_profiles_fail_with_one_line(tmp_path, entries, message):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(entries))
    with pytest.raises(ValueError, match=message):
        load_profile(path)


def test_bad_workflow_flags_fail_before_anything_loads():
    with pytest.raises(ValueError, match="--max_turns must be >= 1"):
        EnvConfig(max_turns=0)
    with pytest.raises(ValueError, match="--workflow must be one of"):
        EnvConfig(workflow="tree")
    with pytest.raises(ValueError, match="the profile describes a sequential workflow; give a profile with an orchestrator"):
        workflow_for(load_profile("reasoner_actor"), "orchestrated")


def test_the_cli_stops_on_a_cyclic_graph_before_the_model_loads(tmp_path, capsys):
    from marft.cli.train import main

    path = tmp_path / "cycle.json"
    path.write_text(json.dumps({"agents": [{"role": "A"}, {"role": "B", "with_answer": True}], "graph": {"edges": [["A", "B"], ["B", "A"]]}}))
    assert main(["--profile_path", str(path), "--model_name_or_path", str(tmp_path / "no_model"), "--output_dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has a cycle" in err[0]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------- the turn buffer's GAE
def per_env_walk(rewards, values, terminated, played, gamma, lam):
    """Plain reference: list each env's played turns in order and run textbook GAE along that list."""
    T, E, S = rewards.shape
    adv = torch.zeros(T, E, S)
    for e in range(E):
        turns = [(t, s) for t in range(T) for s in range(S) if played[t, e, s]]
        running, next_value = 0.0, float(values[T, e, 0])
        for i in range(len(turns) - 1, -1, -1):
            t, s = turns[i]
            last_of_step = i == len(turns) - 1 or turns[i + 1][0] != t
            if last_of_step and terminated[t, e]:
                next_value, running = 0.0, 0.0
            delta = float(rewards[t, e, s]) + gamma * next_value - float(values[t, e, s])
            running = delta + gamma * lam * running
            adv[t, e, s] = running
            next_value = float(values[t, e, s])
    return adv


def test_gae_along_each_envs_own_turns_matches_a_per_env_walk():
    torch.manual_seed(0)
    T, E, S = 4, 5, 5
    counts = torch.randint(1, S + 1, (T, E))  # turns per step per env, filled from slot 0
    played = torch.arange(S) < counts.unsqueeze(-1)
    rewards, values = torch.randn(T, E, S) * played, torch.randn(T + 1, E, S)
    terminated = torch.rand(T, E) < 0.3
    adv, ret = agent_chain_gae(rewards, values, terminated, 0.9, 0.8, played=played)
    torch.testing.assert_close(adv, per_env_walk(rewards, values, terminated, played, 0.9, 0.8))
    assert (adv[~played] == 0).all()


# ---------------------------------------------------------------------- the sequential core = the fixed order
def run_config(model_dir, tmp_path, profile="reasoner_actor", env="dense_relay_sum", **algo) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(model_name_or_path=model_dir, profile_path=profile, max_new_tokens=6, context_window=128),
        env=EnvConfig(env_name=env, horizon=2),
        algo=AlgoConfig(**algo),
        runner=RunnerConfig(n_rollout_threads=3, episode_length=3, num_env_steps=9, eval_episodes=2, n_eval_threads=2,
                            output_dir=str(tmp_path / "run"), seed=3),
    )


@pytest.mark.parametrize("algorithm", ["APPO", "TPPO"])
def test_the_turn_core_gives_the_fixed_order_rollout_and_advantages(random_model_dir, tmp_path, algorithm):
    """RolloutCollector.collect (turn by turn) against the old fixed-order loop (``play_step`` of tests/team_oracle.py per step, every agent's
    reply at once to ``env.step``), same seed: same transcripts, ids, log-probs, values and advantages."""
    from marft.launch import build_runner
    from marft.runner.shared.buffer import RolloutBuffer

    runner = build_runner(run_config(random_model_dir, tmp_path, algorithm_name=algorithm))
    torch.manual_seed(11)
    buffer, _ = runner.collector.collect(0)
    runner.trainer.compute_advantages(buffer)

    reference = build_runner(run_config(random_model_dir, tmp_path / "ref", algorithm_name=algorithm))
    team, envs, T = reference.team, reference.envs, 3
    ref = RolloutBuffer(T, envs.n_envs, team.n_agents, team.prompts.max_prompt_len, 6, team.pad_id)
    torch.manual_seed(11)
    obs = reference.collector.obs
    with team.headers.frozen():
        for t in range(T):
            outs = play_step(team, list(obs), list(envs.private_observations), token_values=algorithm == "TPPO")
            for agent, out in enumerate(outs):
                ref.insert_turn(t, agent, out)
            obs, rewards, terminated, truncated, _ = envs.step([[out.texts[e] for out in outs] for e in range(envs.n_envs)])
            ref.insert_step(t, rewards, terminated, truncated)
        first = [p[0] for p in envs.private_observations]
        ids, mask = team.encode_prompts(0, list(obs), [[] for _ in obs], first)
        ref.values[T, :, 0] = team.critic.values(ids, mask, agent=0)
    reference.trainer.compute_advantages(ref)
    for name in ("agent", "prompt_ids", "response_ids", "response_mask", "rewards"):
        assert torch.equal(getattr(buffer, name), getattr(ref, name)), name
    for name in ("logprobs", "values", "advantages", "returns", "token_values", "token_advantages"):
        torch.testing.assert_close(getattr(buffer, name), getattr(ref, name), rtol=0, atol=1e-6, msg=name)
    assert buffer.played.all() and buffer.response_mask.sum() > 0


def test_a_chain_graph_profile_trains_exactly_like_the_plain_list(random_model_dir, tmp_path):
    """The sequential workflow is the chain graph: the same seed gives the same transcripts and weights."""
    from marft.launch import build_runner

    chain = tmp_path / "chain.json"
    chain.write_text(json.dumps({"agents": json.loads((PROFILE_DIR / "reasoner_actor.json").read_text()),
                                 "graph": {"edges": [["Reasoner", "Actor"]]}}))
    results = []
    for profile in ("reasoner_actor", str(chain)):
        runner = build_runner(run_config(random_model_dir, tmp_path / profile.replace("/", "_"), profile=profile))
        assert runner.envs.bases[0].workflow.name == ("sequential" if profile == "reasoner_actor" else "graph")
        torch.manual_seed(5)
        buffer, _ = runner.collector.collect(0)
        runner.trainer.compute_advantages(buffer)
        runner.trainer.update(buffer, 0)
        results.append((buffer, {n: p.detach().clone() for n, p in runner.team.model.named_parameters() if "lora_" in n}))
    (plain, plain_weights), (graph, graph_weights) = results
    assert torch.equal(plain.response_ids, graph.response_ids)
    for name in plain_weights:
        torch.testing.assert_close(graph_weights[name], plain_weights[name], rtol=0, atol=1e-6, msg=name)


# ---------------------------------------------------------------------- orchestrated and graph runs
def test_an_orchestrated_rollout_routes_envs_differently_and_trains_every_agent(random_model_dir, tmp_path, scripted_orchestrator):
    from marft.launch import build_runner

    runner = build_runner(run_config(random_model_dir, tmp_path, profile="route_orchestrated_anonymous", env="dense_route"))
    team = runner.team
    before = {a: [p.detach().clone() for p in team.adapter_parameters(a)] for a in team.policy_adapters}
    buffer, _ = runner.collector.collect(0)
    S = 2 * 5 + 1
    assert buffer.agent.shape == (3, 3, S)
    turns = buffer.played.sum(-1)  # (T, E) turns per step
    assert turns.min() >= 1 and turns.max() > turns.min()  # steps of different lengths
    assert (buffer.agent[:, :, 0] == 2).all()  # the orchestrator opens every step
    assert {0, 1} <= set(buffer.agent[buffer.played].tolist())  # both specialists were called
    runner.trainer.compute_advantages(buffer)
    assert (buffer.advantages[~buffer.played] == 0).all() and buffer.advantages[buffer.played].abs().sum() > 0
    stats = runner.diagnostics.rollout_stats(buffer)
    assert stats["roles/Agent 3/turns_per_step"] >= 1 and "orchestrator/calls_per_step_Agent 1" in stats
    runner.trainer.update(buffer, 0)
    for adapter, params in before.items():
        assert any(not torch.equal(p, q) for p, q in zip(params, team.adapter_parameters(adapter))), adapter


def test_invalid_orchestrator_replies_are_counted_by_the_trainer(random_model_dir, tmp_path):
    """A random model never writes a tag: every training step ends on an invalid reply, counted where checkpoints keep it."""
    from marft.launch import build_runner

    runner = build_runner(run_config(random_model_dir, tmp_path, profile="route_orchestrated_anonymous", env="dense_route"))
    buffer, stats = runner.collector.collect(0)
    assert (buffer.played.sum(-1) == 1).all()  # the orchestrator's one turn per step
    assert stats["invalid_orchestrator_replies"] == 3 * 3  # T x E
    runner._iteration(0)  # the runner adds each rollout's count to the trainer's counters
    assert runner.trainer.counters["orchestrator_invalid"] == 3 * 3
    assert "orchestrator_invalid" in runner.trainer.state_dict()["counters"]


def test_train_orchestrator_false_keeps_the_orchestrator_as_it_is(random_model_dir, tmp_path, scripted_orchestrator):
    from marft.launch import build_runner

    runner = build_runner(run_config(random_model_dir, tmp_path, profile="route_orchestrated_anonymous", env="dense_route",
                                     train_orchestrator=False))
    assert runner.trainer.agents_to_train(0) == [0, 1]
    orchestrator = runner.team.agent_adapters[2]
    before = [p.detach().clone() for p in runner.team.adapter_parameters(orchestrator)]
    buffer, _ = runner.collector.collect(0)
    runner.trainer.compute_advantages(buffer)
    runner.trainer.update(buffer, 0)
    assert all(torch.equal(p, q) for p, q in zip(before, runner.team.adapter_parameters(orchestrator)))


def test_orchestrated_and_graph_runs_write_per_role_diagnostics_and_transcripts(random_model_dir, tmp_path, scripted_orchestrator):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from marft.cli.train import main

    base = ["--model_name_or_path", random_model_dir, "--max_new_tokens", "6", "--context_window", "160", "--n_rollout_threads", "2",
            "--episode_length", "1", "--num_env_steps", "4", "--eval_episodes", "3", "--n_eval_threads", "2"]
    runs = {"orchestrated": ["--env_name", "dense_route", "--profile_path", "route_orchestrated", "--workflow", "orchestrated"],
            "graph": ["--env_name", "math", "--profile_path", "solvers_verifier_graph", "--workflow", "graph"]}
    for name, extra in runs.items():
        run = tmp_path / name
        assert main(base + extra + ["--output_dir", str(run)]) == 0
        lines = (run / "transcripts" / "eval_2.jsonl").read_text().splitlines()
        episode = json.loads(lines[0])
        assert len(lines) == 3 and all(turn["role"] for step in episode["steps"] for turn in step)
        events = EventAccumulator(str(run / "logs"))
        events.Reload()
        tags = events.Tags()["scalars"]
        roles = ["Keeper 1", "Keeper 2", "Orchestrator"] if name == "orchestrated" else ["Solver A", "Solver B", "Verifier"]
        assert all(f"roles/{role}/reply_tokens" in tags for role in roles), tags
        if name == "orchestrated":
            assert "eval_orchestrator/calls_per_step_Keeper 1" in tags and "orchestrator/calls_per_step_Keeper 2" in tags
            summary = json.loads((run / "summary.json").read_text())
            assert set(summary["orchestrator_calls_after"]) == {"Keeper 1", "Keeper 2", "Orchestrator", "invalid"}
