"""Seconds per training iteration and peak memory of one configuration.

One iteration = one rollout batch (every agent on every env, with scoring and
values) + one PPO update. The first iteration is a warm-up and not timed.
Run one configuration per process so the peak-memory figures do not mix:

    python scripts/bench_iteration.py --algorithm_name APPO --n_agents 2
    python scripts/bench_iteration.py --algorithm_name TPPO --n_agents 2
    python scripts/bench_iteration.py --algorithm_name APPO --n_agents 4
    python scripts/bench_iteration.py --model random --hidden_size 512 --num_layers 8 --algorithm_name TPPO

Prints progress, then ONE line of JSON with the figures.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time

import torch

from marft.config import AlgoConfig, EnvConfig, ModelConfig, RunnerConfig, TrainConfig
from marft.train import validate

PROFILES = {1: "reasoner_actor", 2: "reasoner_actor", 3: "planner_solver_verifier", 4: "planner_solver_reflector_verifier"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm_name", default="APPO", choices=["APPO", "TPPO"])
    p.add_argument("--n_agents", type=int, default=2, choices=[2, 3, 4])
    p.add_argument("--model", default="marft-tiny", help="marft-tiny, a model folder, or 'random' (see --hidden_size)")
    p.add_argument("--hidden_size", type=int, default=512, help="random model: hidden size")
    p.add_argument("--num_layers", type=int, default=8, help="random model: layers")
    p.add_argument("--n_rollout_threads", type=int, default=4)
    p.add_argument("--episode_length", type=int, default=1)
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--context_window", type=int, default=512)
    p.add_argument("--iterations", type=int, default=3, help="timed iterations (after one warm-up)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(args) -> str:
    if args.model != "random":
        return args.model
    from marft.models.tiny import build_random_model

    return build_random_model(tempfile.mkdtemp(prefix="marft_bench_"), hidden_size=args.hidden_size, num_layers=args.num_layers)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from marft.agents.loading import load_base_model
    from marft.agents.team import AgentTeam
    from marft.algorithms import make_trainer
    from marft.envs.vector import TextVectorEnv
    from marft.runner.shared.runner import Runner

    config = TrainConfig(
        model=ModelConfig(
            model_name_or_path=build_model(args), profile_path=PROFILES[args.n_agents], n_agents=args.n_agents,
            max_new_tokens=args.max_new_tokens, context_window=args.context_window, device=args.device, dtype=args.dtype,
        ),
        env=EnvConfig(),
        algo=AlgoConfig(algorithm_name=args.algorithm_name, ppo_epoch=1),
        runner=RunnerConfig(n_rollout_threads=args.n_rollout_threads, episode_length=args.episode_length, seed=args.seed, eval_episodes=1),
    )
    profile, make_train_env, make_eval_env = validate(config)
    torch.manual_seed(args.seed)
    model, tokenizer = load_base_model(config.model)
    team = AgentTeam(model, tokenizer, profile, config.model)
    trainer = make_trainer(team, config.algo)
    envs = TextVectorEnv([make_train_env] * args.n_rollout_threads)
    runner = Runner(config, team, trainer, envs, make_eval_env, tempfile.mkdtemp(prefix="marft_bench_run_"))
    if team.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rollout_s, update_s, tokens = [], [], []
    for i in range(args.iterations + 1):
        start = time.perf_counter()
        buffer, stats = runner.collect()
        middle = time.perf_counter()
        trainer.compute_advantages(buffer)
        trainer.update(buffer, i)
        if team.device.type == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        print(f"iteration {i}: rollout {middle - start:.2f}s, update {end - middle:.2f}s" + (" (warm-up)" if i == 0 else ""), flush=True)
        if i > 0:
            rollout_s.append(middle - start)
            update_s.append(end - middle)
            tokens.append(int(buffer.response_mask.sum()))
    params = sum(p.numel() for n, p in team.model.named_parameters() if "lora_" not in n)
    adapters = sum(p.numel() for n, p in team.model.named_parameters() if "lora_" in n)
    result = {
        "bench": "iteration",
        "algo": args.algorithm_name,
        "n_agents": args.n_agents,
        "model": args.model if args.model != "random" else f"random-h{args.hidden_size}-l{args.num_layers}",
        "device": str(team.device),
        "n_rollout_threads": args.n_rollout_threads,
        "max_new_tokens": args.max_new_tokens,
        "seconds_per_iteration": (sum(rollout_s) + sum(update_s)) / args.iterations,
        "rollout_s": sum(rollout_s) / args.iterations,
        "update_s": sum(update_s) / args.iterations,
        "reply_tokens_per_iteration": sum(tokens) / args.iterations,
        "base_params_m": params / 1e6,
        "adapter_params_m": adapters / 1e6,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if team.device.type == "cuda":
        result["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
