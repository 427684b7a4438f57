"""``--kl_reference`` (issue 30, item 4): the KL penalty's reference after a warm start.

A run started from a checkpoint (``scripts/sft.py``'s warm start, ``--load_path``) keeps the adapters it starts
from, frozen, as its reference (``initial``, the default there): its KL is 0 at iteration 0, where the bare base
model's (``base``) pulls the team back to before the warm start. The references are frozen adapters
(``ref_<adapter>``), never in an optimizer, saved in checkpoints, and a resumed run keeps them.
"""

import json

import pytest
import torch

from marft.agents.adapters import adapter_of
from marft.config import AlgoConfig, EnvConfig, ModelConfig, RunnerConfig, TrainConfig
from marft.launch import build_runner, resolve_kl_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def config(model_dir, run, horizon=2, **algo) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(model_name_or_path=model_dir, max_new_tokens=6, context_window=128),
        env=EnvConfig(env_name="dense_relay_sum", horizon=horizon),
        algo=AlgoConfig(**{"ppo_epoch": 1, "num_mini_batch": 1, **algo}),
        runner=RunnerConfig(n_rollout_threads=2, episode_length=1, num_env_steps=4, output_dir=str(run)),
    )


def lora(team, adapter) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in team.model.named_parameters() if adapter_of(n) == adapter}


@pytest.fixture(scope="module")
def warm_start(random_model_dir, tmp_path_factory):
    """A checkpoint at iteration 0 whose policy adapters are far from zero (as ``scripts/sft.py`` saves one): its path
    and its adapters' weights."""
    run = tmp_path_factory.mktemp("warm")
    runner = build_runner(config(random_model_dir, run))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in runner.team.model.named_parameters():
            if "lora_B" in name and adapter_of(name) in runner.team.policy_adapters:
                p.normal_(std=0.3)
    runner.config.algo.kl_reference = "auto"  # as scripts/sft.py writes it: resolved by the run that loads it
    path = runner.save(0)
    return path, {a: lora(runner.team, a) for a in runner.team.policy_adapters}


def one_update(random_model_dir, run, load_path, **algo):
    cfg = config(random_model_dir, run, kl_coef=0.5, **algo)
    cfg.runner.load_path = str(load_path)
    runner = build_runner(cfg)
    runner.restore(load_path)
    buffer, _ = runner.collector.collect(0)
    runner.trainer.compute_advantages(buffer)
    return runner, buffer


def test_initial_reference_has_zero_kl_at_the_start_and_base_does_not(random_model_dir, warm_start, tmp_path):
    path, _ = warm_start
    kls = {}
    for reference in ("base", "initial", "auto"):
        runner, buffer = one_update(random_model_dir, tmp_path / reference, path, kl_reference=reference)
        assert runner.config.algo.kl_reference == ("initial" if reference == "auto" else reference)
        metrics = runner.trainer.update(buffer, 0)  # one epoch, one minibatch: the KL logged is before the step
        kls[reference] = [v for k, v in metrics.items() if k.endswith("/kl_to_reference")]
        assert len(kls[reference]) == runner.team.n_agents
    assert all(kl > 1e-3 for kl in kls["base"]), kls
    assert all(abs(kl) < 1e-6 for kl in kls["initial"] + kls["auto"]), kls


def test_reference_adapters_are_frozen_copies_and_only_the_policies_train(random_model_dir, warm_start, tmp_path):
    path, loaded = warm_start
    runner, buffer = one_update(random_model_dir, tmp_path / "run", path, kl_reference="initial")
    team, trainer = runner.team, runner.trainer
    assert set(team.reference_adapters) == set(team.policy_adapters)
    for adapter, reference in team.reference_adapters.items():
        for (name, value), (ref_name, ref_value) in zip(sorted(loaded[adapter].items()), sorted(lora(team, reference).items())):
            assert name.replace(f".{adapter}.", f".{reference}.") == ref_name
            assert torch.equal(value, ref_value), ref_name
    in_optimizers = {id(p) for opt in [*trainer.policy_optimizers.values(), *trainer.critic_optimizers.values()] for g in opt.param_groups for p in g["params"]}
    references = {r: lora(team, r) for r in team.reference_adapters.values()}
    assert not any(id(p) in in_optimizers for r in references for p in team.adapter_parameters(r))
    policies = {a: lora(team, a) for a in team.policy_adapters}
    trainer.update(buffer, 0)
    trainer.update(buffer, 1)
    for reference, before in references.items():
        after = lora(team, reference)
        assert all(torch.equal(before[n], after[n]) for n in before), f"{reference} moved"
    for adapter, before in policies.items():
        after = lora(team, adapter)
        assert any(not torch.equal(before[n], after[n]) for n in before), f"{adapter} did not train"
    assert not any(p.requires_grad for r in references for p in team.adapter_parameters(r))


def test_a_resumed_run_keeps_its_reference(random_model_dir, warm_start, tmp_path):
    """The checkpoint records the resolved reference and holds the frozen adapters: a resume (config from the
    checkpoint, as the command line merges it) keeps the warm start's adapters as reference, not the trained ones."""
    path, loaded = warm_start
    runner, buffer = one_update(random_model_dir, tmp_path / "run", path)
    runner.trainer.update(buffer, 0)
    saved = runner.save(1)
    assert json.loads((saved / "config.json").read_text())["algo"]["kl_reference"] == "initial"
    resumed_config = TrainConfig.from_dict(json.loads((saved / "config.json").read_text()))
    resumed_config.runner.load_path = str(saved)
    resumed_config.runner.output_dir = str(tmp_path / "resumed")
    resumed = build_runner(resumed_config)
    resumed.restore(saved)
    for adapter, reference in resumed.team.reference_adapters.items():
        ref = lora(resumed.team, reference)
        assert all(torch.equal(value, ref[n.replace(f".{adapter}.", f".{reference}.")]) for n, value in loaded[adapter].items())
        assert lora(resumed.team, adapter).keys() and any(
            not torch.equal(value, lora(resumed.team, adapter)[n]) for n, value in loaded[adapter].items()
        ), "the policy should have trained away from the warm start"

    # a run that started from the base model keeps base when resumed
    fresh = build_runner(config(random_model_dir, tmp_path / "fresh", kl_coef=0.5))
    assert fresh.config.algo.kl_reference == "base" and not fresh.team.reference_adapters
    later = config(random_model_dir, tmp_path / "later")
    later.runner.load_path = str(fresh.save(1))
    assert resolve_kl_reference(later) == "base"


def test_resuming_without_a_saved_reference_says_what_the_reference_is(random_model_dir, warm_start, tmp_path, caplog):
    """A run trained without the KL saves no reference adapters; resumed with the KL and an ``initial`` reference,
    the reference can only be the adapters as resumed, and the restore says so (a warm start at iteration 0 does not)."""
    path, _ = warm_start
    runner, buffer = one_update(random_model_dir, tmp_path / "run", path, kl_reference="base")
    runner.config.algo.kl_coef = 0.0
    saved = runner.save(1)
    assert not any(p.name.startswith("ref_") for p in saved.iterdir())
    cfg = config(random_model_dir, tmp_path / "resumed", kl_coef=0.5, kl_reference="initial")
    cfg.runner.load_path = str(saved)
    with caplog.at_level("WARNING", logger="marft.runner.shared.checkpoint"):
        build_runner(cfg).restore(saved)
    assert "has no KL reference" in caplog.text and "iteration 1" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="marft.runner.shared.checkpoint"):
        one_update(random_model_dir, tmp_path / "warm_again", path, kl_reference="initial")
    assert "has no KL reference" not in caplog.text


# ---------------------------------------------------------------------- the KL's weight per algorithm
@pytest.mark.parametrize("algorithm,given,recorded", [
    ("APPO", None, 0.1), ("TPPO", None, 0.1), ("GRPO", None, 0.0125), ("GRPO", 0.1, 0.1), ("APPO", 0.0, 0.0),
])
def test_kl_coef_not_given_is_the_algorithms_default_and_the_run_records_it(random_model_dir, tmp_path, algorithm, given, recorded):
    """GRPO's default weight is an eighth of MARFT-A's and MARFT-T's (its advantages are zero on most replies once
    most groups all solve: choices.KL_COEF_DEFAULTS); a weight given is kept, and the run records the weight it used,
    so a resume keeps it whatever the defaults become."""
    runner = build_runner(config(random_model_dir, tmp_path / "run", horizon=1, algorithm_name=algorithm, group_size=2, kl_coef=given))
    assert runner.config.algo.kl_coef == recorded and runner.trainer.config.effective_kl_coef == recorded
    assert json.loads((runner.save(1) / "config.json").read_text())["algo"]["kl_coef"] == recorded


def test_a_warm_start_leaves_the_kl_weight_to_the_algorithm_of_the_run_after_it(random_model_dir, tmp_path, caplog):
    """scripts/sft.py saves --kl_coef as given (none: None); RL from it with GRPO, the flags not given coming from
    the warm start's config as the command line merges them, gets GRPO's default, not MARFT-A's."""
    from marft.cli.sft import main as sft_main
    from marft.runner.shared.checkpoint import resume_config

    common = ["--model_name_or_path", random_model_dir, "--env_name", "dense_relay_sum", "--max_new_tokens", "6",
              "--context_window", "128", "--n_rollout_threads", "2"]
    episode = {"problem": "What is x + 50?", "turns": [{"role": "Reasoner", "text": "7 + 50 = 57"}, {"role": "Actor", "text": "\\boxed{57}"}]}
    (tmp_path / "t.jsonl").write_text(json.dumps(episode) + "\n")
    assert sft_main([*common, "--sft_steps", "1", "--sft_data", str(tmp_path / "t.jsonl"), "--output_dir", str(tmp_path / "sft")]) == 0
    warm = tmp_path / "sft" / "checkpoints" / "steps_0"
    assert json.loads((warm / "config.json").read_text())["algo"]["kl_coef"] is None
    rl = config(random_model_dir, tmp_path / "rl", horizon=1, algorithm_name="GRPO", group_size=2)
    rl.runner.load_path = str(warm)
    rl = resume_config(rl, {"algorithm_name", "group_size", "horizon", "output_dir", "load_path"})
    with caplog.at_level("INFO", logger="marft"):
        runner = build_runner(rl)
        runner.restore(warm)
    assert runner.config.algo.kl_coef == 0.0125
    assert "--kl_coef 0.0125: GRPO's default" in caplog.text and "kl_coef changed" not in caplog.text  # not a change
    assert "starting from the warm start with --algorithm_name 'GRPO' ('APPO' in its config)" in caplog.text
    assert "resuming with" not in caplog.text
