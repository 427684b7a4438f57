"""Benchmarks: does the team learn where the answer is known, and what does marft cost?

    python scripts/benchmark.py learning [--algorithm_name TPPO] [--agent_iteration_interval 128]
    python scripts/benchmark.py learning --workflow orchestrated   # route: a trained orchestrator learns whom to call
    python scripts/benchmark.py learning --env_name code          # generated f(x) code tasks, graded in the sandbox
    python scripts/benchmark.py rollout  [--model random --hidden_size 512 --num_layers 8]
    python scripts/benchmark.py update   [--algorithm_name TPPO]
    python scripts/benchmark.py iteration [--algorithm_name TPPO] [--n_agents 4] [--model random]
    python scripts/benchmark.py rollout --model qwen2.5-0.5b-shape --device cuda --dtype bfloat16 \\
        --n_rollout_threads 32 --max_new_tokens 256

* ``learning``: trains a 2-agent team on the cooperative ``relay_sum`` env (fixed seed) with the
  library's runner and reports, before and after training, the success rate on held-out episodes of
  the test split (``success_*``: (key, number) pairs never trained on) and on fresh episodes of the
  training tasks (``train_tasks_success_*``), and the wall time of training with its evaluations. It
  writes ``learning_curve.png`` (success rate, return, per-role entropy and clip fraction, zero-advantage share
  per iteration) next to the TensorBoard logs, and gives the curve in numbers as ``curve`` (per
  ``--eval_interval`` iterations: mean training success, held-out success at the block's end, each role's entropy).
  With ``--algorithm_name GRPO`` it plays the same 32 envs as groups of ``--group_size`` (4 groups of 8 at the
  default; 32 rounded up to a multiple of another group size) for the same 384 iterations: each update holds 2
  rounds of groups, each group on one task (why 32: docs/results/benchmarks.md).
  ``--workflow orchestrated`` trains an orchestrator and two specialists on ``route`` (the orchestrator must call
  whoever keeps the asked box) and also reports the orchestrator's calls per role before and after;
  ``--env_name code`` trains a Reasoner -> Actor code team on the generated ``f(x)`` tasks (success: every
  hidden test passes). Both run on ``marft-tiny-instruct``, the embedded model whose warm start knows the
  orchestration tags and code (``marft.models.tiny_instruct``).
* ``rollout``: tokens per second of the team's rollout (``RolloutCollector.collect``: every agent on every env,
  prompts encoded, replies sampled, log-probs scored, values computed) against plain
  ``model.generate`` of the same number of tokens on the same prompt batches, same LoRA adapter.
* ``update``: seconds per training update (``trainer.update``) against a plain forward + backward +
  optimizer step over the same minibatches of tokens with the same adapters.
* ``iteration``: seconds per whole training iteration (rollout + advantages + update; of the update, the
  ``--max_update_kl`` line search's share as ``update_bound_s``, and its cut updates) and peak memory
  (process RSS; on CUDA also the peak allocated GPU memory). Run one configuration per process so the
  peak-memory figures do not mix.

Each prints progress, then ONE line of JSON with its figures (the last line of stdout).

``learning`` and ``iteration`` also run data-parallel, e.g. on CPU
``OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 scripts/benchmark.py iteration``: each process
takes ``--n_rollout_threads / P`` envs, and only rank 0 prints (its own timings).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from marft.algorithms import trust_region
from marft.config import SECTIONS, AlgoConfig, TrainConfig, build_parser

SHAPED_MODELS = {
    "qwen2.5-0.5b-shape": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0, tie_word_embeddings=True),
    "qwen2.5-1.5b-shape": dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0, tie_word_embeddings=True),
}
"""Real checkpoints' shapes (their ``config.json``) with random weights, for ``--model NAME``: the compute and memory
of the real model where its weights cannot be fetched (no model hub here)."""

RELAY_LEARNING_ENVS = 32
"""Envs per iteration in ``learning`` on ``relay_sum``, and with GRPO on any env (rounded up to a multiple of
``--group_size``): 16 (the other benches' default) leaves some seeds short of the optimum (docs/results/benchmarks.md)."""

PROFILES = {2: "reasoner_actor", 3: "planner_solver_verifier", 4: "planner_solver_reflector_verifier"}
"""The shipped profile used for each ``--n_agents``."""


BENCHMARK_DEFAULTS = {
    "env_name": None, "profile_path": None, "max_new_tokens": None, "n_rollout_threads": None, "num_env_steps": None,
    "n_agents": 2, "context_window": 256, "device": "cpu", "experiment_name": "benchmark", "update_on_constant_rewards": None,
}
"""Where the benchmark's defaults differ from a training run's (:mod:`marft.config`); None: chosen by
:func:`parse_args` from the bench, the env and the algorithm."""


def parse_args(argv=None) -> argparse.Namespace:
    """The benchmark's own flags, then every training flag of :mod:`marft.config` (its docstrings as help) with
    :data:`BENCHMARK_DEFAULTS`; ``--model`` stands for ``--model_name_or_path``."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("bench", choices=["learning", "rollout", "update", "iteration", "adapters"])
    p.add_argument("--model", default=None, help="marft-tiny, marft-tiny-instruct, marft-small, a model folder, 'random' (see --hidden_size), 'qwen2.5-0.5b-shape' or 'qwen2.5-1.5b-shape' "
                   "(default: marft-tiny-instruct, whose warm start knows the tags and code, with --workflow orchestrated or --env_name code; else marft-tiny)")
    p.add_argument("--hidden_size", type=int, default=512, help="random model: hidden size")
    p.add_argument("--num_layers", type=int, default=8, help="random model: layers")
    p.add_argument("--sft_steps", type=int, default=0, help="learning: supervised warm-start steps of the adapters on the env's demonstrations before RL")
    p.add_argument("--n_demonstrations", type=int, default=2000, help="learning: demonstrations drawn for the warm start (--sft_steps)")
    p.add_argument("--recovery_share", type=float, default=0.0, help="learning: the share of demonstrated moves made after a rejected "
                   "attempt (TextArena games; see marft sft --recovery_share)")
    p.add_argument("--repeats", type=int, default=3, help="rollout/update/iteration: timed repetitions after one warm-up")
    p.add_argument("--no_profile", action="store_true", help="rollout: skip the per-phase time breakdown")
    p.add_argument("--adapters", type=int, default=4, help="adapters: the rows' adapters (the trained one and frozen snapshots of it)")
    p.add_argument("--compare_backend", default=None, help="rollout: also time this --generation_backend on the same team and envs, "
                   "the two taking turns repeat by repeat (e.g. --generation_backend decode_loop --compare_backend vllm)")
    build_parser(parser=p, defaults=BENCHMARK_DEFAULTS, exclude=("model_name_or_path",), flat=True)
    args = p.parse_args(argv)
    orchestrated = args.workflow == "orchestrated"
    args.env_name = args.env_name or ("route" if orchestrated else "relay_sum")
    code = args.env_name == "code"
    args.profile_path = args.profile_path or ("route_orchestrated" if orchestrated else "reasoner_actor_code" if code else PROFILES[args.n_agents])
    args.model = args.model or ("marft-tiny-instruct" if orchestrated or code else "marft-tiny")
    if args.max_new_tokens is None:
        args.max_new_tokens = 24 if code else 16
    if args.n_rollout_threads is None:
        learning = args.bench == "learning"
        if learning and args.algorithm_name == "GRPO":
            args.n_rollout_threads = math.ceil(RELAY_LEARNING_ENVS / args.group_size) * args.group_size  # whole groups
        else:
            args.n_rollout_threads = RELAY_LEARNING_ENVS if learning and args.env_name == "relay_sum" else 16
    if args.num_env_steps is None:
        args.num_env_steps = (128 if code else 384) * args.n_rollout_threads * args.episode_length
    if args.update_on_constant_rewards is None:
        args.update_on_constant_rewards = args.bench != "learning"  # timings: the policies are updated on every batch
    if args.profile_path is None and args.n_agents not in PROFILES:
        p.error(f"--n_agents {args.n_agents} has no shipped profile here ({sorted(PROFILES)}); pass --profile_path")
    return args


def model_path(args) -> str:
    """The model to load: a name/folder as given, or a freshly built random model."""
    if args.model != "random" and args.model not in SHAPED_MODELS:
        return args.model
    from marft.models.tiny import build_random_model

    path = tempfile.mkdtemp(prefix="marft_bench_model_")
    if args.model == "random":
        return build_random_model(path, hidden_size=args.hidden_size, num_layers=args.num_layers)
    return build_shaped_model(path, SHAPED_MODELS[args.model], args.dtype)


def build_shaped_model(path: str, shape: dict, dtype: str) -> str:
    """A randomly initialised Qwen2 model of the given shape, with the embedded tokenizer.

    The tokenizer is smaller than the vocabulary; sampled ids beyond it decode to nothing,
    which is fine for timing (the compute is that of the full vocabulary)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from marft.agents.dtypes import TORCH_DTYPES
    from marft.models.tiny import build_random_model

    build_random_model(path)  # the tokenizer (and a tiny model, replaced below)
    tokenizer_config = json.loads(Path(path, "config.json").read_text())
    config = Qwen2Config(**shape, eos_token_id=tokenizer_config["eos_token_id"], pad_token_id=tokenizer_config["pad_token_id"])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(TORCH_DTYPES[dtype])
    model.save_pretrained(path)
    return path


def model_label(args) -> str:
    return f"random-h{args.hidden_size}-l{args.num_layers}" if args.model == "random" else args.model


def make_config(args, run_dir: str | None) -> TrainConfig:
    """The training config of the benchmark's flags: every config field from ``args``, the model from :func:`model_path`."""
    values = {section: {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name != "model_name_or_path"}
              for section, cls in SECTIONS.items()}
    values["model"]["model_name_or_path"] = model_path(args)
    values["runner"]["output_dir"] = run_dir
    values["model"]["n_agents"] = None  # --n_agents picks a shipped profile (PROFILES); the profile says the team size
    try:
        return TrainConfig.from_dict(values)
    except ValueError as error:  # a bad flag value: one line, as marft train gives it
        raise SystemExit(f"error: {error}") from None


def emit(result: dict) -> dict:
    print(json.dumps(result), flush=True)
    return result


# ---------------------------------------------------------------------------- learning


def read_scalars(log_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Every scalar of a run's TensorBoard logs: ``{tag: (iterations, values)}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    points = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
    return {tag: ([p.step for p in ps], [p.value for p in ps]) for tag, ps in points.items()}


def role_tags(scalars: dict, name: str) -> dict[str, str]:
    """``losses/agent_<role>/<name>`` tags by role."""
    return {tag.split("/")[1].removeprefix("agent_"): tag for tag in sorted(scalars)
            if tag.startswith("losses/agent_") and tag.endswith("/" + name)}


def learning_curve_summary(log_dir: Path, block: int) -> list[dict]:
    """The learning curve in numbers, one entry per ``block`` iterations (the evaluation interval): the mean
    training success of its iterations, the held-out success evaluated at its last iteration (None when there was
    no evaluation then), and each role's mean token entropy (nats), so a table can show what the picture shows."""
    scalars = read_scalars(log_dir)
    steps, success = scalars.get("charts/accuracy", ([], []))
    held_out = dict(zip(*scalars.get("eval/accuracy", ([], []))))
    entropies = {role: dict(zip(*scalars[tag])) for role, tag in role_tags(scalars, "entropy").items()}
    by_iteration = dict(zip(steps, success))
    summary = []
    for first in range(1, max(steps, default=0) + 1, block):
        iterations = [i for i in range(first, first + block) if i in by_iteration]
        if not iterations:
            continue
        last = iterations[-1]
        summary.append({
            "iterations": [first, last],
            "success": round(statistics.fmean(by_iteration[i] for i in iterations), 3),
            "held_out": round(held_out[last], 3) if last in held_out else None,
            "entropy": {role: round(statistics.fmean(v[i] for i in iterations if i in v), 3)
                        for role, v in entropies.items() if any(i in v for i in iterations)},
        })
    return summary


def plot_learning_curve(log_dir: Path) -> Path | None:
    """The learning curve from the TensorBoard logs → PNG, four panels over iterations: success rate (training
    episodes and held-out evaluations), team return, each role's mean token entropy (a collapse to ~0 before
    success nears its optimum is a policy that stopped exploring), and each role's PPO clip fraction with the
    share of turns whose advantage is exactly 0 (batches or GRPO groups that teach nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scalars = read_scalars(log_dir)

    def series(tag):
        return scalars.get(tag, ([], []))

    fig, ((ax_success, ax_return), (ax_entropy, ax_clip)) = plt.subplots(2, 2, figsize=(11, 7.5))
    ax_success.plot(*series("charts/accuracy"), label="training episodes")
    ax_success.plot(*series("eval/accuracy"), "o--", label="held-out evaluation")
    ax_success.set(xlabel="iteration", ylabel="success rate", ylim=(-0.02, 1.02), title="Success rate")
    ax_success.legend()
    ax_return.plot(*series("charts/episode_return"), label="training episodes")
    ax_return.plot(*series("eval/return"), "o--", label="held-out evaluation")
    ax_return.set(xlabel="iteration", ylabel="team return", title="Episode return")
    ax_return.legend()
    for role, tag in role_tags(scalars, "entropy").items():
        ax_entropy.plot(*series(tag), label=role)
    ax_entropy.set(xlabel="iteration", ylabel="mean token entropy (nats)", title="Policy entropy per role")
    ax_entropy.legend()
    for role, tag in role_tags(scalars, "clip_frac").items():
        ax_clip.plot(*series(tag), label=f"clip fraction, {role}")
    ax_clip.plot(*series("charts/zero_advantage_share"), ":", label="turns with zero advantage")
    ax_clip.set(xlabel="iteration", ylabel="share", ylim=(-0.02, 1.02), title="Clipped ratios and zero advantages")
    ax_clip.legend()
    fig.tight_layout()
    path = log_dir / "learning_curve.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def eval_transcripts(args) -> list[Path]:
    """The run's evaluation transcripts (``transcripts/eval_<iteration>.jsonl``), in iteration order."""
    return sorted((Path(args.output_dir) / "transcripts").glob("eval_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))


def route_calls(runner, args) -> dict:
    """``right_calls_before`` / ``right_calls_after``: on ``route``, the share of held-out episodes whose first
    orchestrator reply calls the keeper of the asked shelf (0.5 is routing at random), read from the first and the
    last evaluation's transcripts (``transcripts/eval_<iteration>.jsonl``)."""
    from marft.envs.route.env import RouteEnv, asked_shelf
    from marft.envs.workflows import workflow_for

    keepers = RouteEnv(profile=runner.team.profile).keepers  # keepers[k]: the agent who keeps shelf k
    parse = workflow_for(runner.team.profile, "orchestrated").parse

    def right_share(path: Path) -> float | None:
        episodes = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        right = sum(parse(e["steps"][0][0]["text"]) == keepers[asked_shelf(e["problem"])] for e in episodes)
        return right / len(episodes) if episodes else None

    evaluations = eval_transcripts(args)
    if not evaluations:
        return {}
    return {"right_calls_before": right_share(evaluations[0]), "right_calls_after": right_share(evaluations[-1])}


def game_results(runner, args) -> dict:
    """``games_before`` / ``games_after``: on a game env (``textarena:<id>``), the first and the last evaluation's win /
    draw / loss rates per seat and invalid-move rate (:func:`marft.trained.evaluate.game_figures`), read from their
    transcripts (``transcripts/eval_<iteration>.jsonl``)."""
    from marft.trained.evaluate import game_figures

    evaluations = eval_transcripts(args)
    if not evaluations:
        return {}
    figures = [game_figures([json.loads(line) for line in path.read_text().splitlines() if line.strip()], runner.roles)
               for path in (evaluations[0], evaluations[-1])]
    return {"games_before": figures[0].get("games"), "games_after": figures[1].get("games")} if figures[0] else {}


def bench_learning(args) -> dict:
    """Train on the env's train split; report success on held-out episodes of the test split (tasks
    never trained on) and on fresh episodes of the training tasks, before and after."""
    args.output_dir = args.output_dir or str(Path("results") / "benchmark" / time.strftime("%Y%m%d-%H%M%S"))
    runner, config, make_train_env = build_runner(args)
    print(
        f"learning: {args.algorithm_name} on {args.env_name}, {config.num_iterations} iterations of "
        f"{args.n_rollout_threads} envs x {args.episode_length} steps, agent_iteration_interval {args.agent_iteration_interval}",
        flush=True,
    )
    start = time.perf_counter()
    if args.sft_steps:  # the protocol first (e.g. the orchestrator's tags, with routing at random), then RL
        from marft.sft import SFTConfig, demonstrations, training_reply_loss, turn_examples, warm_start

        examples = turn_examples(runner.team.prompts, demonstrations(make_train_env, args.n_demonstrations, args.seed, args.recovery_share),
                                 eos_id=runner.team.eos_id,
                                 max_reply_tokens=args.max_new_tokens)
        losses = warm_start(runner.team, examples, SFTConfig(sft_steps=args.sft_steps), seed=args.seed)
        warm_start_loss = training_reply_loss(runner.team, examples)
        print(f"warm start: {args.sft_steps} steps, reply loss {losses[0]:.3f} -> {losses[-1]:.3f} (last step's batch), "
              f"{warm_start_loss:.3f} over the training turns ({time.perf_counter() - start:.0f}s)", flush=True)
        if config.algo.effective_kl_coef > 0 and args.kl_reference == "auto":  # the KL keeps the warm start, as after --load_path
            runner.team.add_reference_adapters()
            config.algo.kl_reference = "initial"
    train_tasks_before = runner.evaluate(make_env=make_train_env)
    summary = runner.run()  # evaluates on the test split before and after training
    seconds = time.perf_counter() - start
    train_tasks_after = runner.evaluate(make_env=make_train_env)
    print(f"training tasks, fresh episodes: success {train_tasks_before['accuracy']:.3f} -> {train_tasks_after['accuracy']:.3f}", flush=True)
    log_dir = Path(args.output_dir) / "logs"
    plot = plot_learning_curve(log_dir) if runner.dist.is_main else None  # rank 0 wrote the logs
    curve = learning_curve_summary(log_dir, args.eval_interval or max(1, summary["iterations"] // 10)) if runner.dist.is_main else None
    print(f"learning curve: {plot}", flush=True)
    return emit({
        "bench": "learning",
        "algo": args.algorithm_name,
        "env": args.env_name,
        "workflow": args.workflow,
        "agent_iteration_interval": args.agent_iteration_interval,
        "success_before": summary["accuracy_before"],
        "success_after": summary["accuracy_after"],
        "return_before": summary["return_before"],
        "return_after": summary["return_after"],
        "train_tasks_success_before": train_tasks_before["accuracy"],
        "train_tasks_success_after": train_tasks_after["accuracy"],
        "seconds": round(seconds, 1),
        **({"calls_before": summary["orchestrator_calls_before"], "calls_after": summary["orchestrator_calls_after"]}
           if "orchestrator_calls_before" in summary else {}),
        **(route_calls(runner, args) if args.env_name == "route" else {}),
        **(game_results(runner, args) if args.env_name.startswith("textarena:") else {}),
        "iterations": summary["iterations"],
        "seed": args.seed,
        "run_dir": args.output_dir,
        "plot": str(plot),
        "curve": curve,
    })


# ---------------------------------------------------------------------------- shared setup


def build_runner(args):
    """The library's runner (``marft.launch.build_runner``) on a throw-away run directory unless
    ``--output_dir``; returns ``(runner, config, make_train_env)``."""
    from marft.launch import build_runner as build_library_runner
    from marft.launch import validate

    config = make_config(args, args.output_dir or tempfile.mkdtemp(prefix="marft_bench_run_"))
    validated = validate(config)
    runner = build_library_runner(config, validated)
    team = runner.team
    n_base = sum(p.numel() for n, p in team.model.named_parameters() if "lora_" not in n)
    print(f"model {model_label(args)}: {n_base / 1e6:.1f}M base parameters on {team.device} ({args.dtype})", flush=True)
    return runner, config, validated[1]


def setup_fields(args, team) -> dict:
    """The JSON fields every timing benchmark reports: what ran, on what, at which sizes."""
    return {
        "algo": args.algorithm_name,
        "model": model_label(args),
        "device": str(team.device),
        "dtype": args.dtype,
        "n_agents": team.n_agents,
        "n_envs": args.n_rollout_threads,
        "max_new_tokens": args.max_new_tokens,
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def turns_of(buffer, device) -> list[tuple[int, torch.Tensor, torch.Tensor, int]]:
    """Every agent turn of a rollout as ``(agent, prompt_ids (E, P), prompt_mask (E, P), generated)``,
    where ``generated`` is how many tokens generate produced (the longest reply, EOS included)."""
    from marft.types import TurnBatch

    T, E, N = buffer.shape
    turns = []
    for t in range(T):
        for agent in range(N):
            batch = TurnBatch(prompt_ids=buffer.prompt_ids[t, :, agent], prompt_mask=buffer.prompt_mask[t, :, agent]).trimmed(device)
            generated = int(buffer.response_mask[t, :, agent].sum(-1).max())
            turns.append((agent, batch.prompt_ids, batch.prompt_mask, max(generated, 1)))
    return turns


@contextmanager
def phase_timer(team, totals: dict):
    """Time the team's phases (encode, generate, score, values, decode) by wrapping the methods of its parts."""
    phases = [(team, "encode_prompts", "encode"), (team, "sample", "generate"), (team, "response_logprobs", "score_logprobs"),
              (team, "decode", "decode")]
    if team.critic is not None:
        phases += [(team.critic, name, "critic_values") for name in ("values", "token_values", "value_batches")]

    def wrap(phase, fn):
        def timed(*a, **k):
            synchronize(team.device)
            start = time.perf_counter()
            out = fn(*a, **k)
            synchronize(team.device)
            totals[phase] = totals.get(phase, 0.0) + time.perf_counter() - start
            return out
        return timed

    for owner, name, phase in phases:
        setattr(owner, name, wrap(phase, getattr(owner, name)))
    try:
        yield totals
    finally:
        for owner, name, _ in phases:
            delattr(owner, name)


# ---------------------------------------------------------------------------- rollout


@torch.no_grad()
def plain_generate(team, turns, adapters: bool = True) -> float:
    """Seconds for ``model.generate`` on the same prompt batches, exactly the same number of new tokens each."""
    from contextlib import nullcontext

    seconds = 0.0
    for agent, prompt_ids, prompt_mask, generated in turns:
        config = team.sampling.generation_config()
        config.max_new_tokens = config.min_new_tokens = generated
        team.model.set_adapter(team.agent_adapters[agent])
        with nullcontext() if adapters else team.model.disable_adapter():
            synchronize(team.device)
            start = time.perf_counter()
            team.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
            synchronize(team.device)
        seconds += time.perf_counter() - start
    return seconds


def bench_rollout(args) -> dict:
    runner, config, _ = build_runner(args)
    team = runner.team
    runner.collector.collect()  # warm-up
    marft_s = generate_s = base_s = 0.0
    tokens = reply_tokens = 0
    for r in range(args.repeats):
        synchronize(team.device)
        start = time.perf_counter()
        buffer, _ = runner.collector.collect()
        synchronize(team.device)
        collect_s = time.perf_counter() - start
        turns = turns_of(buffer, team.device)
        gen_s = plain_generate(team, turns)
        base_s += plain_generate(team, turns, adapters=False)
        n = sum(ids.shape[0] * generated for _, ids, _, generated in turns)
        marft_s, generate_s, tokens = marft_s + collect_s, generate_s + gen_s, tokens + n
        reply_tokens += int(buffer.response_mask.sum())
        print(f"repeat {r}: {n} tokens, marft rollout {collect_s:.2f}s, plain generate {gen_s:.2f}s", flush=True)
    profile = {}
    if not args.no_profile:
        with phase_timer(team, profile):
            synchronize(team.device)
            start = time.perf_counter()
            runner.collector.collect()
            synchronize(team.device)
            profile["total"] = time.perf_counter() - start
        profile["other"] = profile["total"] - sum(v for k, v in profile.items() if k != "total")
        print("one rollout, seconds per phase: " + ", ".join(f"{k} {v:.3f}" for k, v in profile.items()), flush=True)
    compared = compare_backends(args, runner) if args.compare_backend else {}
    return emit({
        "bench": "rollout",
        **setup_fields(args, team),
        **compared,
        "tokens": tokens,
        "reply_tokens": reply_tokens,
        "marft_tokens_per_s": tokens / marft_s,
        "generate_tokens_per_s": tokens / generate_s,
        "marft_reply_tokens_per_s": reply_tokens / marft_s,  # the replies' own tokens (no pads after an end)
        "generate_reply_tokens_per_s": reply_tokens / generate_s,  # the same replies, generate's seconds
        "ratio": generate_s / marft_s,
        "generate_no_lora_tokens_per_s": tokens / base_s,
        "profile_s": {k: round(v, 4) for k, v in profile.items()},
    })


def bench_adapters(args) -> dict:
    """Rows of ``--adapters K`` adapters (the trained one and K - 1 frozen snapshots of it, as ``--opponent pool:K``
    plays them) sampled by the first agent: in one batch, each row through its own adapter, against one batch per
    adapter (each folded into the base weights where ``--merge_lora_in_rollout`` can), taking turns for ``--repeats``
    repeats after one warm-up each, greedily (both ways write the same replies). Reply tokens per second of each, and
    which one the team uses on this device."""
    runner, _, _ = build_runner(args)
    team = runner.team
    team.set_top_k(1)
    names = [team.agent_adapters[0]] + [f"snapshot_{k}" for k in range(1, args.adapters)]
    for name in names[1:]:
        team.bank.add_frozen_copies({team.agent_adapters[0]: name})
    base = runner.collector.envs.bases[0]
    histories = [base.reset(options={"task_index": k})[0] for k in range(args.n_rollout_threads)]
    rows = [names[k % len(names)] for k in range(len(histories))]
    seconds, tokens = {"one_batch": 0.0, "batch_per_adapter": 0.0}, {"one_batch": 0, "batch_per_adapter": 0}
    chosen = team.mix_adapters
    for repeat in range(args.repeats + 1):
        for way in seconds:
            team.mix_adapters = way == "one_batch"
            synchronize(team.device)
            start = time.perf_counter()
            with team.headers.frozen():
                out = team.act(0, histories, [[]] * len(histories), adapters=rows)
            synchronize(team.device)
            if repeat:  # the first round warms up
                seconds[way] += time.perf_counter() - start
                tokens[way] += int(out.response_mask.sum())
    team.mix_adapters = chosen
    return emit({
        "bench": "adapters", **setup_fields(args, team), "adapters": len(names),
        **{f"{way}_reply_tokens_per_s": tokens[way] / seconds[way] for way in seconds},
        "one_batch_speedup": (tokens["one_batch"] / seconds["one_batch"]) / (tokens["batch_per_adapter"] / seconds["batch_per_adapter"]),
        "team_uses": "one_batch" if team.mixes_adapter_rows() else "batch_per_adapter",
    })


def compare_backends(args, runner) -> dict:
    """Rollouts of the run's ``--generation_backend`` and of ``--compare_backend`` on the same team and envs, taking
    turns for ``--repeats`` repeats after one warm-up each: ``{"backends": {name: reply tokens per second of whole
    rollouts}}`` (sampling, scoring, critic values and env steps, as training runs them)."""
    from marft.agents.backends import make_backend

    team = runner.team
    backends = {team.config.generation_backend: team.backend}
    float32 = next(team.model.parameters()).dtype == torch.float32  # the backends that sample with the team's model record log-probs as they go
    backends[args.compare_backend] = make_backend(args.compare_backend, team.headers, team.sampling, float32, config=team.config,
                                                  previous=team.backend)
    seconds, tokens = dict.fromkeys(backends, 0.0), dict.fromkeys(backends, 0)
    for backend in backends.values():
        team.backend = backend
        runner.collector.collect()  # warm-up (an engine loads its adapters)
    for r in range(args.repeats):
        for name, backend in backends.items():
            team.backend = backend
            synchronize(team.device)
            start = time.perf_counter()
            buffer, _ = runner.collector.collect()
            synchronize(team.device)
            seconds[name] += time.perf_counter() - start
            tokens[name] += int(buffer.response_mask.sum())
            print(f"repeat {r}: {name} {tokens[name] / seconds[name]:.0f} reply tokens/s", flush=True)
    team.backend = backends[team.config.generation_backend]
    result = {"backends": {name: {"reply_tokens_per_s": round(tokens[name] / seconds[name], 1), "seconds": round(seconds[name], 3)}
                           for name in backends}}
    engine = getattr(backends.get("vllm"), "engine", None)
    if engine is not None:  # what re-sending one updated adapter costs (written, loaded, the old version removed)
        adapter, times = team.policy_adapters[0], []
        for _ in range(args.repeats):
            with torch.no_grad():
                for p in team.adapter_parameters(adapter):
                    p.mul_(1.0)  # an in-place write: the engine must take the adapter again
            start = time.perf_counter()
            engine.sync.request(adapter)
            times.append(time.perf_counter() - start)
        size = sum(p.numel() * p.element_size() for p in team.adapter_parameters(adapter))
        result["adapter_sync"] = {"ms": round(1000 * sum(times) / len(times), 1), "adapter_mib": round(size / 2**20, 2)}
    return result


# ---------------------------------------------------------------------------- update


def _plain_minibatches(n: int, num_mini_batch: int):
    size = -(-n // num_mini_batch)
    return torch.randperm(n).split(size)


def plain_update(team, config: AlgoConfig, buffer, token_level: bool, optimizers: dict) -> float:
    """The reference workload: for the critic and each agent, ``ppo_epoch`` passes of forward + backward +
    optimizer step over the same minibatches of tokens, with a minimal loss and no PPO bookkeeping, every row
    running its whole prompt. Returns the share of padding in its policy forwards."""
    from marft.agents.critic import CRITIC_ADAPTER
    from marft.agents.headers import position_ids_from_mask

    model = team.model
    decoder = model.get_base_model().get_decoder()
    samples = buffer.critic_samples(token_level)
    model.set_adapter(CRITIC_ADAPTER)
    for _ in range(config.ppo_epoch):
        for idx in _plain_minibatches(samples.prompt_ids.shape[0], config.num_mini_batch):
            mb = samples.rows(idx).trimmed(team.device)
            if token_level:
                L = mb.response_ids.shape[1]
                ids = torch.cat([mb.prompt_ids, mb.response_ids], 1)  # (B, P + L)
                mask = torch.cat([mb.prompt_mask, mb.response_mask], 1)  # (B, P + L)
                hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).last_hidden_state
                values = team.critic.value_head(hidden[:, -L - 1 : -1].float()).squeeze(-1)  # (B, L)
                loss = ((values - mb.token_returns) ** 2 * mb.response_mask).sum() / mb.response_mask.sum()
            else:
                mask = mb.prompt_mask
                hidden = decoder(input_ids=mb.prompt_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).last_hidden_state
                values = team.critic.value_head(hidden[:, -1].float()).squeeze(-1)  # (B,)
                loss = ((values - mb.returns) ** 2).mean()
            loss.backward()
            optimizers[CRITIC_ADAPTER].step()
            optimizers[CRITIC_ADAPTER].zero_grad(set_to_none=True)
    positions = padding = 0
    for agent in range(team.n_agents):
        adapter = team.agent_adapters[agent]
        samples = buffer.agent_samples(agent, token_level)
        model.set_adapter(adapter)
        for _ in range(config.ppo_epoch):
            for idx in _plain_minibatches(samples.prompt_ids.shape[0], config.num_mini_batch):
                mb = samples.rows(idx).trimmed(team.device)
                L = mb.response_ids.shape[1]
                ids = torch.cat([mb.prompt_ids, mb.response_ids], 1)  # (B, P + L)
                mask = torch.cat([mb.prompt_mask, mb.response_mask], 1)  # (B, P + L)
                positions, padding = positions + mask.numel(), padding + int((mask == 0).sum())
                logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), logits_to_keep=L + 1).logits
                logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, mb.response_ids.unsqueeze(-1)).squeeze(-1)  # (B, L)
                weight = mb.token_advantages if token_level else mb.advantages.unsqueeze(-1)
                loss = -(logp * weight * mb.response_mask).sum() / mb.response_mask.sum()
                loss.backward()
                optimizers[adapter].step()
                optimizers[adapter].zero_grad(set_to_none=True)
    return padding / positions


def bench_update(args) -> dict:
    from marft.agents.critic import CRITIC_ADAPTER

    if args.algorithm_name == "GRPO":
        raise SystemExit("update compares the critic-based trainers to plain forward+backward passes of the critic and the agents; "
                         "time GRPO against APPO with the iteration benchmark")
    runner, config, _ = build_runner(args)
    team, trainer = runner.team, runner.trainer
    buffer, _ = runner.collector.collect()
    trainer.compute_advantages(buffer)
    optimizers = {a: torch.optim.AdamW(team.adapter_parameters(a), lr=config.algo.lr) for a in team.policy_adapters}
    optimizers[CRITIC_ADAPTER] = torch.optim.AdamW(team.critic.trainable_parameters(), lr=config.algo.critic_lr)

    def timed(fn) -> float:
        synchronize(team.device)
        start = time.perf_counter()
        fn()
        synchronize(team.device)
        return time.perf_counter() - start

    def plain():
        team.critic.value_head.requires_grad_(True)  # peft's set_adapter makes the active adapter (only) trainable
        pad_shares["plain"] = plain_update(team, config.algo, buffer, trainer.token_level, optimizers)

    pad_shares, metrics = {}, {}
    timed(lambda: trainer.update(buffer, 0))  # warm-up
    timed(plain)
    marft_s, plain_s = [], []
    for r in range(args.repeats):  # interleaved so that drift affects both alike
        marft_s.append(timed(lambda: metrics.update(trainer.update(buffer, r))))  # noqa: B023 - called at once
        plain_s.append(timed(plain))
        print(f"repeat {r}: marft update {marft_s[-1]:.2f}s, plain forward+backward {plain_s[-1]:.2f}s", flush=True)
    team.set_active(None)
    marft_mean, plain_mean = sum(marft_s) / len(marft_s), sum(plain_s) / len(plain_s)
    return emit({
        "bench": "update",
        **setup_fields(args, team),
        "reply_tokens": int(buffer.response_mask.sum()),
        "ppo_epoch": args.ppo_epoch,
        "marft_s": marft_mean,
        "plain_s": plain_mean,
        "ratio": marft_mean / plain_mean,
        "pad_share": statistics.mean(v for k, v in metrics.items() if k.endswith("/pad_share")),  # of the policy forwards' positions
        "plain_pad_share": pad_shares["plain"],
    })


# ---------------------------------------------------------------------------- iteration


@contextmanager
def timed_update_bound(seconds: list[float]):
    """Time every ``--max_update_kl`` line search (:func:`marft.algorithms.trust_region.bound_update`) into ``seconds``."""
    bound = trust_region.bound_update

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return bound(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    trust_region.bound_update = timed
    try:
        yield
    finally:
        trust_region.bound_update = bound


def bench_iteration(args) -> dict:
    runner, config, _ = build_runner(args)
    team, trainer = runner.team, runner.trainer
    if team.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rollout_s, update_s, tokens, bound_s = [], [], [], []
    for i in range(args.repeats + 1):  # iteration 0 is a warm-up
        synchronize(team.device)
        start = time.perf_counter()
        buffer, _ = runner.collector.collect(i)
        synchronize(team.device)
        middle = time.perf_counter()
        trainer.compute_advantages(buffer)
        bounds = []
        with timed_update_bound(bounds):
            trainer.update(buffer, i)
        synchronize(team.device)
        end = time.perf_counter()
        print(f"iteration {i}: rollout {middle - start:.2f}s, update {end - middle:.2f}s" + (" (warm-up)" if i == 0 else ""), flush=True)
        if i > 0:
            last_buffer = buffer
            bound_s.append(sum(bounds))
            rollout_s.append(middle - start)
            update_s.append(end - middle)
            tokens.append(int(buffer.response_mask.sum()))
    named = list(team.model.named_parameters())
    result = {
        "bench": "iteration",
        **setup_fields(args, team),
        "chunk_tokens": trainer.chunk_tokens,
        "episode_length": args.episode_length,
        "ppo_epoch": args.ppo_epoch,
        "seconds_per_iteration": (sum(rollout_s) + sum(update_s)) / args.repeats,
        "rollout_s": sum(rollout_s) / args.repeats,
        "update_s": sum(update_s) / args.repeats,
        "update_bound_s": sum(bound_s) / args.repeats,  # --max_update_kl's line search, part of update_s (0 with none)
        "cut_updates": trainer.counters.get("cut_updates", 0) + trainer.counters.get("undone_updates", 0),
        "reply_tokens_per_iteration": sum(tokens) / args.repeats,
        "seconds_per_1k_reply_tokens": 1000 * (sum(rollout_s) + sum(update_s)) / max(sum(tokens), 1),
        "base_params_m": sum(p.numel() for n, p in named if "lora_" not in n) / 1e6,
        "adapter_params_m": sum(p.numel() for n, p in named if "lora_" in n) / 1e6,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if team.device.type == "cuda":
        result["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
    if update_s:
        result.update(update_utilization(trainer, last_buffer, args.repeats, update_s[-1], team.device, next(team.model.parameters()).dtype))
    return emit(result)


def peak_matmul_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """This device's TFLOP/s for one large square product in ``dtype`` (4096 on a GPU, 2048 on CPU), the best of 5:
    the rate the update's utilization is measured against (a measured rate, not the card's data sheet)."""
    n = 4096 if device.type == "cuda" else 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e12


def update_utilization(trainer, buffer, iteration: int, seconds: float, device: torch.device, dtype: torch.dtype) -> dict:
    """The last timed update's FLOPs (its buffer updated once more under torch's FLOP counter, after the timing: matrix
    products and attention, forward and backward, the reference and line-search forwards included) and its model FLOP
    utilization: those FLOPs over its seconds, against :func:`peak_matmul_tflops`. The counted update starts from the
    policy the timed one left, so a ``--max_update_kl`` line search may cut it another number of times (one more
    forward per cut): the FLOPs are those of the same batch, not always of the very same passes."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        trainer.update(buffer, iteration)
    flops = counter.get_total_flops()
    peak = peak_matmul_tflops(device, dtype)
    return {"update_tflop": flops / 1e12, "update_tflops_per_s": flops / seconds / 1e12, "peak_matmul_tflops": peak,
            "update_mfu": flops / seconds / 1e12 / peak}


def main(argv=None) -> dict:
    args = parse_args(argv)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun / accelerate launch, rank 0 reports
        sys.stdout = open(os.devnull, "w")
    benches = {"learning": bench_learning, "rollout": bench_rollout, "update": bench_update, "iteration": bench_iteration,
               "adapters": bench_adapters}
    return benches[args.bench](args)


if __name__ == "__main__":
    from marft.faults import ExitCode, Preempted

    try:
        main(sys.argv[1:])
    except Preempted as stop:  # SIGTERM / Ctrl-C during RL: the runner saved a checkpoint; no JSON line for a cut run
        print(f"stopped: {stop} (with marft train; a stopped benchmark prints no JSON line)", file=sys.stderr)
        sys.exit(ExitCode.PREEMPTED)
