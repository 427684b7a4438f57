"""``--generation_backend vllm`` against the trainer, on the CPU build of vLLM (run in the environment that has it:
``.venv-vllm/bin/python -m pytest tests/vllm_engine_checks.py``; ``tests/agents/test_vllm_backend.py`` runs it from the
main suite). One engine for the module (an engine per process)."""

import dataclasses
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from marft.agents.backends import make_backend
from marft.agents.generation import DecodeLoop
from marft.agents.team import AgentTeam
from marft.config import ModelConfig
from marft.envs.profile import load_profile
from marft.launch import seed_everything
from marft.models.loading import load_base_model

ROOT = Path(__file__).resolve().parents[1]
HISTORIES = ["Problem: What is 3 + 4?\n", "Problem: What is 13 - 4?\nReasoner: 13 - 4 = 9\n", "Problem: What is 1 + 1?\n"] * 4
GAP = 1e-3
"""Largest mean |engine − trainer| log-prob gap per reply token accepted (float32)."""


def draws():
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


@pytest.fixture(scope="module")
def team():
    """The reasoner/actor team with a critic, two different non-zero adapters, its replies sampled on the engine
    (built last, the run's random streams checked around it)."""
    config = ModelConfig(model_name_or_path="marft-tiny", max_new_tokens=16, context_window=256)
    model, tokenizer = load_base_model(config)
    torch.manual_seed(0)
    team = AgentTeam(model, tokenizer, load_profile("reasoner_actor", n_agents=2), config, with_critic=True)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in team.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    team.config = dataclasses.replace(config, generation_backend="vllm")
    seed_everything(123)
    team.expected_draws = draws()
    seed_everything(123)
    team.backend = make_backend("vllm", team.headers, team.sampling, False, config=team.config)
    team.draws_after_engine = draws()
    yield team
    team.backend.engine.close()


def test_building_the_engine_leaves_the_runs_random_streams_alone(team):
    """vLLM seeds python, numpy and torch when its worker starts in this process; the run's seeds must hold."""
    assert team.draws_after_engine == team.expected_draws


def act(team, agent, seed):
    torch.manual_seed(seed)
    return team.act(agent, HISTORIES, [[] for _ in HISTORIES])


def mean_gap(out) -> float:
    mask = out.response_mask.bool()
    assert mask.any()
    return float((out.logprobs - out.sampling_logprobs)[mask].abs().mean())


def engine_loras(team) -> set[int]:
    return set(team.backend.engine.llm.llm_engine.list_loras())


def test_the_trainer_scores_the_engines_replies_as_the_engine_does(team):
    assert team.backend.engine.padding is not None  # marft-tiny's 16-dimensional heads are served padded on CPU
    for agent in (0, 1):
        out = act(team, agent, seed=agent)
        assert out.sampling_logprobs is not None
        assert mean_gap(out) <= GAP
    figures = team.rollout_figures()
    assert figures["rollout/engine_logprob_gap_mean"] <= GAP
    assert figures["rollout/adapter_syncs"] == 2.0  # each adapter sent once


def test_a_seeded_rollout_samples_the_same_replies(team):
    assert torch.equal(act(team, 0, seed=5).response_ids, act(team, 0, seed=5).response_ids)
    assert not torch.equal(act(team, 0, seed=5).response_ids, act(team, 0, seed=6).response_ids)


def test_greedy_replies_are_decode_loops(team):
    engine_backend = team.backend
    team.set_top_k(1)
    try:
        assert team.backend.engine is engine_backend.engine  # a new backend on the same engine
        greedy = act(team, 1, seed=0)
        team.backend = DecodeLoop(team.headers, team.sampling, True)
        reference = act(team, 1, seed=0)
    finally:
        team.backend = engine_backend
        team.set_top_k(0)  # a new backend on the same engine again
    assert torch.equal(greedy.response_ids, reference.response_ids)
    assert torch.equal(greedy.response_mask, reference.response_mask)


def test_a_rollout_larger_than_one_engine_step_samples_seeded_replies(team):
    """More prompt tokens than the engine schedules in one step: vLLM's chunked prefill would split a prompt over
    two steps and rewind its seeded generator, which a CPU generator refuses ("CPU Generator does not use
    offset"); whole prompts per step sample every row, and a seeded rollout still repeats."""
    long_histories = [f"Problem: What is {i} + {i + 1}?\n" + "Reasoner: I add the two numbers.\n" * 6 for i in range(96)]
    scheduler = team.backend.engine.llm.llm_engine.vllm_config.scheduler_config
    prompt_tokens = sum(len(ids) for ids in team.prompts.encode_rows(0, long_histories, [[] for _ in long_histories]))
    assert prompt_tokens > scheduler.max_num_batched_tokens  # the rollout takes more than one step's budget
    torch.manual_seed(4)
    first = team.act(0, long_histories, [[] for _ in long_histories])
    torch.manual_seed(4)
    again = team.act(0, long_histories, [[] for _ in long_histories])
    assert first.response_mask.sum(1).min() > 0 and torch.equal(first.response_ids, again.response_ids)
    assert mean_gap(first) <= GAP


def test_an_update_of_one_agent_resends_only_its_adapter(team):
    first, second = team.agent_adapters
    assert first != second
    act(team, 0, seed=9), act(team, 1, seed=9)
    held = dict(team.backend.engine.sync.served)
    before_0, before_1 = act(team, 0, seed=3), act(team, 1, seed=3)
    with torch.no_grad():  # what an optimizer step of agent 1 does: its tensors change in place
        for p in team.adapter_parameters(second):
            p.add_(torch.randn_like(p) * 0.3)
    after_0, after_1 = act(team, 0, seed=3), act(team, 1, seed=3)
    served = team.backend.engine.sync.served
    assert served[first][1].lora_int_id == held[first][1].lora_int_id  # agent 0's adapter was not re-sent
    assert served[second][1].lora_int_id != held[second][1].lora_int_id
    assert engine_loras(team) <= {served[first][1].lora_int_id, served[second][1].lora_int_id}  # the old version is gone
    assert not os.path.exists(held[second][1].lora_path)
    assert team.critic_adapters and set(served) == set(team.policy_adapters)  # critics never go to the engine
    assert torch.equal(after_0.response_ids, before_0.response_ids)  # agent 0 unchanged
    assert not torch.equal(after_1.response_ids, before_1.response_ids)  # agent 1 follows its new adapter ...
    assert mean_gap(after_1) <= GAP  # ... exactly


def test_two_hundred_syncs_keep_engine_memory_and_lora_slots_bounded(team):
    second = team.agent_adapters[1]
    root = team.backend.engine.sync.root
    process = psutil.Process()
    rss = []
    for sync in range(200):
        with torch.no_grad():
            for p in team.adapter_parameters(second):
                p.mul_(0.999)
        torch.manual_seed(sync)
        team.act(1, HISTORIES[:4], [[] for _ in range(4)])
        assert len(engine_loras(team)) <= 2
        assert len(list(root.iterdir())) <= 2  # one folder per adapter on disk
        if sync in (19, 199):
            rss.append(process.memory_info().rss)
    assert team.rollout_figures()["rollout/adapter_syncs"] >= 200
    assert rss[1] - rss[0] < 64 * 2**20, f"resident memory grew by {(rss[1] - rss[0]) / 2**20:.0f} MiB over 180 syncs"


def test_training_runs_to_the_end_and_a_seeded_run_repeats(tmp_path):
    """Two short runs of the default math team on the engine: the same accuracies; the logged gap is small and
    the adapters were re-sent after updates."""
    summaries = []
    for run in ("a", "b"):
        result = subprocess.run(
            [sys.executable, "scripts/train_math.py", "--generation_backend", "vllm", "--num_env_steps", "64", "--output_dir", str(tmp_path / run)],
            capture_output=True, text=True, cwd=ROOT, timeout=900,
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        summaries.append(json.loads((tmp_path / run / "summary.json").read_text()))
    assert summaries[0]["accuracy_before"] == summaries[1]["accuracy_before"]
    assert summaries[0]["accuracy_after"] == summaries[1]["accuracy_after"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "a" / "logs").glob("events*"))))
    events.Reload()
    gaps = [s.value for s in events.Scalars("rollout/engine_logprob_gap_mean")]
    syncs = [s.value for s in events.Scalars("rollout/adapter_syncs")]
    assert gaps and max(gaps) <= GAP
    assert all(count >= 1 for count in syncs[1:])  # every later rollout starts from the updated adapters


def test_one_shared_adapter_is_served_for_every_agent(tmp_path):
    result = subprocess.run(
        [sys.executable, "scripts/train_math.py", "--generation_backend", "vllm", "--shared_lora", "true", "--num_env_steps", "64",
         "--output_dir", str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "run" / "logs").glob("events*"))))
    events.Reload()
    assert [s.value for s in events.Scalars("rollout/adapter_syncs")][1:] == [1.0]  # one adapter, re-sent once after the update
    assert max(s.value for s in events.Scalars("rollout/engine_logprob_gap_mean")) <= GAP


def test_two_processes_each_run_their_own_engine(tmp_path):
    """``torchrun`` with 2 processes (gloo): each process serves its adapters on its own engine (vLLM's
    external_launcher on marft's process group) and the run ends cleanly with the same adapters everywhere."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "scripts/train_math.py",
         "--generation_backend", "vllm", "--num_env_steps", "64", "--device", "cpu", "--output_dir", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=ROOT, timeout=900, env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    logs = result.stdout + result.stderr
    assert logs.count("distributed_executor_backend': 'external_launcher'") == 2  # one engine per process
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == 2


OUTPUT_LAYER_CHECK = """
import dataclasses, json, torch
from marft.agents.backends import make_backend
from marft.agents.team import AgentTeam
from marft.config import ModelConfig
from marft.envs.profile import load_profile
from marft.models.loading import load_base_model
histories = ["Problem: What is 3 + 4?\\n", "Problem: What is 1 + 1?\\n"] * 6
config = ModelConfig(model_name_or_path="marft-tiny", max_new_tokens=16, context_window=256, lora_target_modules="all-linear,lm_head")
model, tokenizer = load_base_model(config)
torch.manual_seed(0)
team = AgentTeam(model, tokenizer, load_profile("reasoner_actor", n_agents=2), config)
generator = torch.Generator().manual_seed(1)
with torch.no_grad():
    for name, p in team.model.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
team.config = dataclasses.replace(config, generation_backend="vllm")
team.backend = make_backend("vllm", team.headers, team.sampling, False, config=team.config)
torch.manual_seed(0)
out = team.act(0, histories, [[] for _ in histories])
mask = out.response_mask.bool()
adapter = team.agent_adapters[0]
with torch.no_grad():
    team.model.get_output_embeddings().lora_B[adapter].weight.zero_()  # the trainer without the output layer's part
    without = team.response_logprobs(adapter, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask).logprobs
print(json.dumps({"gap": float((out.logprobs - out.sampling_logprobs)[mask].abs().mean()),
                  "head_effect": float((out.logprobs - without)[mask].abs().mean())}))
team.backend.engine.close()
"""


def test_an_adapted_output_layer_is_served_as_the_trainer_scores_it():
    """``--lora_target_modules all-linear,lm_head``: the engine applies the output layer's LoRA too (its replies'
    log-probs are the trainer's, where leaving that part out would move them far more). Its own process: one engine
    per process."""
    result = subprocess.run([sys.executable, "-c", OUTPUT_LAYER_CHECK], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["gap"] <= GAP and figures["head_effect"] > 100 * GAP, figures
