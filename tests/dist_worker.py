"""What ``tests/runner/test_distributed.py`` runs in each process of ``torchrun --standalone --nproc_per_node P`` (gloo on CPU).

    dist_worker.py update MODEL_DIR OUT_DIR     one update with P processes vs one process on the union (per case)
    dist_worker.py unequal MODEL_DIR OUT_DIR    the same with 2 processes holding 9 and 12 of 21 turns (and 21 and 0, 0 and 0)
    dist_worker.py train OUT_DIR -- FLAGS...    ``marft.cli.train.main(FLAGS)``; then this rank's weight hash and pid files

Each rank writes ``OUT_DIR/rank<r>.json``.
"""

from __future__ import annotations

import copy
import faulthandler
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

import marft.envs
from marft.envs import StepOutcome
from marft.envs.relay_sum.env import RelaySumEnv


class DenseRelaySum(RelaySumEnv):
    """``relay_sum`` whose reward is the answerer's reply length mod 5, in quarters (a random model never solves the task)."""

    def evaluate(self, state, actions):
        reward = (len(actions[self.answer_index]) % 5) / 4
        return StepOutcome(rewards=(reward,) * self.n_agents, solved=False, feedback="Again.", info={"correct": False})


def trainable(team) -> dict[str, torch.Tensor]:
    """Every adapter's LoRA weights and the value head, by name (detached copies)."""
    out = {n: p.detach().clone() for n, p in team.model.named_parameters() if "lora_" in n}
    if team.critic is not None:  # critic-free teams (GRPO) have none
        out.update({f"value_head.{n}": p.detach().clone() for n, p in team.critic.value_head.named_parameters()})
    return out


def weights_hash(team) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(trainable(team).items()):
        digest.update(name.encode())
        digest.update(tensor.float().numpy().tobytes())
    return digest.hexdigest()


def env_share(buffer, rank: int, world_size: int):
    """The buffer of envs ``[rank * E/P, (rank + 1) * E/P)``: every field has the env axis at dim 1."""
    share = copy.copy(buffer)
    E = buffer.shape[1]
    size = E // world_size
    for name, value in vars(buffer).items():
        if isinstance(value, torch.Tensor):
            setattr(share, name, value[:, rank * size : (rank + 1) * size].clone())
    share.shape = (buffer.shape[0], size, buffer.shape[2])
    return share


CASES = [("APPO", False), ("APPO", True), ("TPPO", False), ("TPPO", True)]


def update_cases(model_dir: str, out_dir: Path, dist) -> dict:
    """Per case and optimizer: the largest difference between the P-process update on env shares and the
    one-process update on the whole batch, how far the weights moved, and this rank's weight hash after the
    P-process update.

    ``sgd`` (lr 1) keeps the weights a linear function of the clipped gradients, so it checks the reduction, the
    global loss units and the global clipping norm to float32 precision; ``adamw`` is the trainer's own optimizer,
    whose ``m / (sqrt(v) + eps)`` magnifies float32 summation-order noise of gradients near zero (up to lr)."""
    from marft.config import AlgoConfig, EnvConfig, ModelConfig, RunnerConfig, TrainConfig
    from marft.distributed import SINGLE
    from marft.launch import build_runner

    results = {}
    for algorithm, shared in CASES:
        name = f"{algorithm}_{'shared' if shared else 'per_agent'}"
        config = TrainConfig(
            model=ModelConfig(model_name_or_path=model_dir, max_new_tokens=6, context_window=128, shared_lora=shared),
            env=EnvConfig(env_name="dense_relay_sum", horizon=2),
            # two epochs, one minibatch in two chunks (units weighted over both processes), clipping active
            algo=AlgoConfig(algorithm_name=algorithm, ppo_epoch=2, num_mini_batch=1, gradient_cp_steps=2, max_grad_norm=0.05, target_kl=1e9),
            runner=RunnerConfig(n_rollout_threads=4, episode_length=2, num_env_steps=8, output_dir=str(out_dir / f"run_{name}_{dist.rank}")),
        )
        os.environ["WORLD_SIZE"] = "1"  # build a one-process runner in every process: the same batch everywhere
        runner = build_runner(config)
        os.environ["WORLD_SIZE"] = str(dist.world_size)
        trainer, team = runner.trainer, runner.team
        buffer, _ = runner.collector.collect()
        trainer.compute_advantages(buffer)
        start = trainable(team)
        for optimizer, lr in (("sgd", 1.0), ("adamw", 1e-3)):
            kind = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
            trainer.config.lr = trainer.config.critic_lr = lr  # load_state_dict sets the config's learning rates
            trainer.policy_optimizers = {a: kind(team.adapter_parameters(a), lr=lr) for a in team.policy_adapters}
            trainer.critic_optimizers = {c: kind(team.critic.trainable_parameters(c), lr=lr) for c in team.critic_adapters}
            optimizers = copy.deepcopy(trainer.state_dict())
            trainer.dist = SINGLE  # the reference: one process, the whole batch
            torch.manual_seed(1)
            trainer.update(buffer, 0)
            reference = trainable(team)
            restore(team, start)
            trainer.load_state_dict(optimizers)
            trainer.dist = dist  # P processes, each on its share of the envs
            torch.manual_seed(1)
            trainer.update(env_share(buffer, dist.rank, dist.world_size), 0)
            got = trainable(team)
            results[f"{name}/{optimizer}"] = {
                "max_diff": max(float((got[k] - reference[k]).abs().max()) for k in reference),
                "moved": max(float((reference[k] - start[k]).abs().max()) for k in reference),
                "hash": weights_hash(team),
            }
            if (algorithm, shared, optimizer) == (*CASES[0], "adamw"):
                results["nan_on_one_rank"] = nan_on_one_rank(trainer, team, buffer, dist)
            restore(team, start)
    return results


def restore(team, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in team.model.named_parameters():
            if n in weights:
                p.copy_(weights[n])
        for n, p in team.critic.value_head.named_parameters() if team.critic is not None else ():
            p.copy_(weights[f"value_head.{n}"])


def nan_on_one_rank(trainer, team, buffer, dist) -> dict:
    """Rank 1's first policy loss is NaN: every rank must skip that step, so the weights stay identical."""
    policy_loss, calls = trainer.policy_loss, [0]

    def poisoned(adapter, mb):
        loss, entropy, stats = policy_loss(adapter, mb)
        calls[0] += 1
        return (loss * float("nan") if dist.rank == 1 and calls[0] == 1 else loss), entropy, stats

    trainer.policy_loss = poisoned
    skipped = trainer.counters["skipped_minibatches"]
    trainer.update(env_share(buffer, dist.rank, dist.world_size), 1)
    trainer.policy_loss = policy_loss
    return {"skipped": trainer.counters["skipped_minibatches"] - skipped, "hash": weights_hash(team)}


BOUNDED = 1e-4
"""The ``--max_update_kl`` of the bounded case (the SGD step of lr 1 is over it)."""
UNEQUAL_CASES = [("APPO", 9), ("TPPO", 9), ("GRPO", 9), ("APPO", 21), ("APPO", 0), ("GRPO", 9, BOUNDED)]
"""(algorithm, rows on rank 0 of the 21 turns of agent 0; rank 1 holds the rest[, a limit on the update's KL]):
9 and 12; 21 and none; ``(APPO, 0)``, where no process has a row of the adapter (the update is skipped on both);
and a ``--max_update_kl`` the update's step is over, so the line search's KL is summed over the processes."""


def unequal_cases(model_dir: str, out_dir: Path, dist) -> dict:
    """Agent 0's policy update (and, with a critic, the critic's on agent 0's turns) with 2 processes holding
    unequal shares of 21 turns, against one process on all 21 (rank 0's rows first), with ``num_mini_batch 4``
    (minibatches of 6, 6, 6, 3 rows: per share ceil(9/4) and ceil(12/4) would give 3 and 4 minibatches), two
    chunks each, two epochs, clipping and the reference KL on. SGD (lr 1) as in :func:`update_cases`."""
    from marft.config import AlgoConfig, EnvConfig, ModelConfig, RunnerConfig, TrainConfig
    from marft.distributed import SINGLE
    from marft.launch import build_runner

    results = {}
    for algorithm, first, *limit in UNEQUAL_CASES:
        name = f"{algorithm}_{first}" + ("_bounded" if limit else "")
        config = TrainConfig(
            model=ModelConfig(model_name_or_path=model_dir, max_new_tokens=6, context_window=128),
            env=EnvConfig(env_name="dense_relay_sum", horizon=3),
            algo=AlgoConfig(algorithm_name=algorithm, ppo_epoch=2, num_mini_batch=4, gradient_cp_steps=2, max_grad_norm=0.05,
                            kl_coef=0.5, group_size=7 if algorithm == "GRPO" else 4, max_update_kl=limit[0] if limit else None),
            runner=RunnerConfig(n_rollout_threads=7, episode_length=3, num_env_steps=21, output_dir=str(out_dir / f"run_{name}_{dist.rank}")),
        )
        os.environ["WORLD_SIZE"] = "1"  # build a one-process runner in every process: the same batch everywhere
        runner = build_runner(config)
        os.environ["WORLD_SIZE"] = str(dist.world_size)
        trainer, team = runner.trainer, runner.team
        buffer, _ = runner.collector.collect()
        trainer.compute_advantages(buffer)
        jobs = [("policy", trainer.update_policy, team.agent_adapters[0], buffer.agent_samples(0, trainer.token_level))]
        if trainer.uses_critic:
            jobs.append(("critic", trainer.update_critic, "critic", buffer.critic_samples(trainer.token_level, [0])))
        start = trainable(team)
        trainer.config.lr = trainer.config.critic_lr = 1.0
        trainer.policy_optimizers = {a: torch.optim.SGD(team.adapter_parameters(a), lr=1.0) for a in team.policy_adapters}
        trainer.critic_optimizers = {c: torch.optim.SGD(team.critic.trainable_parameters(c), lr=1.0) for c in team.critic_adapters}
        for job, update, adapter, samples in jobs:
            assert len(samples.prompt_ids) == 21, len(samples.prompt_ids)
            if first == 0:  # no process has a row
                samples = samples.rows(slice(0, 0))
            trainer.dist = SINGLE
            torch.manual_seed(1)
            update(samples, adapter) if job == "critic" else update(adapter, samples)
            reference = trainable(team)
            restore(team, start)
            share = slice(0, first) if dist.rank == 0 else slice(first, None)
            trainer.dist = dist
            torch.manual_seed(1)
            mine = samples.rows(share)
            metrics = update(mine, adapter) if job == "critic" else update(adapter, mine)
            got = trainable(team)
            results[f"{name}/{job}"] = {
                "max_diff": max(float((got[k] - reference[k]).abs().max()) for k in reference),
                "moved": max(float((reference[k] - start[k]).abs().max()) for k in reference),
                "hash": weights_hash(team),
                "skipped_updates": trainer.counters.get(f"skipped_updates/{adapter}", 0),
                "step_scale": metrics.get("update_step_scale"),
            }
            restore(team, start)
    return results


def train(out_dir: Path, argv: list[str], rank: int) -> dict:
    """``marft.cli.train.main(argv)``, keeping the runner to hash this rank's final weights."""
    import marft.cli.train
    import marft.launch

    (out_dir / f"pid{rank}").write_text(str(os.getpid()))
    runners = []
    build = marft.launch.build_runner

    def keep(*args, **kwargs):
        runners.append(build(*args, **kwargs))
        return runners[-1]

    marft.launch.build_runner = keep
    code = marft.cli.train.main(argv)
    return {"code": code, "hash": weights_hash(runners[0].team) if runners else None}


def main() -> int:
    faulthandler.enable()  # a worker that dies in native code (e.g. SIGABRT) prints every thread's Python stack
    torch.set_num_threads(1)
    marft.envs.register("dense_relay_sum", DenseRelaySum)
    mode, rank = sys.argv[1], int(os.environ.get("RANK", "0"))
    if mode in ("update", "unequal"):
        from marft.distributed import init_distributed, shutdown_distributed

        out_dir = Path(sys.argv[3])
        dist = init_distributed("cpu", 120 if mode == "update" else 60)
        result = (update_cases if mode == "update" else unequal_cases)(sys.argv[2], out_dir, dist)
        dist.barrier()  # every rank done with its collectives before any destroys the group
        shutdown_distributed()  # here, as marft.cli.train.main does when training ends, not in the interpreter's exit
    else:
        out_dir = Path(sys.argv[2])
        result = train(out_dir, sys.argv[sys.argv.index("--") + 1 :], rank)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    return 0 if result.get("code", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
