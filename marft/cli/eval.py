"""``marft eval``: a checkpoint (or the base model) on an environment's held-out split (:func:`marft.trained.evaluate.evaluate`)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from marft.choices import GENERATION_BACKENDS
from marft.cli.common import add_checkpoint_flags, chosen_checkpoint, int_list, parser, run
from marft.trained.evaluate import checkpoint_config, evaluate
from marft.trained.league import league


def build_parser():
    p = parser("marft eval", "Evaluate a trained team on held-out tasks: pass@k, success, per-role statistics, transcripts.")
    add_checkpoint_flags(p, required=False)
    p.add_argument("--base_model", action="store_true", help="evaluate the untrained team (fresh adapters) of the checkpoint's or the flags' config: the 'before' figure")
    p.add_argument("--env_name", help="evaluate on this environment instead of the checkpoint's")
    p.add_argument("--dataset_path", help="the held-out data: a JSON/JSONL file or a folder of <split>.jsonl files (e.g. MATH), "
                   "'humaneval' for code; default: the run's held-out data")
    p.add_argument("--split", default="test", help="the split to evaluate: test, or a folder's <split>.jsonl (e.g. test500)")
    p.add_argument("--n", type=int, default=1, help="samples per task")
    p.add_argument("--k", type=int_list, help="pass@k for these k (comma-separated, each at most --n; default 1)")
    p.add_argument("--episodes", type=int, help="play this many episodes (task = episode %% tasks: more episodes than the split's "
                   "tasks revisit them with fresh samples, distinct_tasks in summary.json) instead of --n per task; "
                   "with the run's --eval_episodes it replays the evaluation training printed")
    p.add_argument("--greedy", action="store_true", help="also play greedily (top-k 1), once per task played: greedy_accuracy (and a game's greedy_games) in summary.json")
    p.add_argument("--n_eval_threads", type=int, help="episodes played at once (default: the run's)")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (default: the run's)")
    p.add_argument("--generation_backend", choices=list(GENERATION_BACKENDS),
                   help="what samples the replies (default: the run's; vllm needs vLLM installed, see docs/vllm.md)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--versus_random", metavar="ROLE", help="self-play games: the random-legal-move player moves for ROLE "
                   "(comma-separated roles: a team game's side); the game figures are the first other role's against it")
    p.add_argument("--versus_checkpoint", metavar="PATH", help="self-play games: --versus_role plays with its adapter from this checkpoint "
                   "(or run directory) of the same team, e.g. the warm start: the trained agent against its initial self")
    p.add_argument("--versus_role", metavar="ROLE", help="the role that plays from --versus_checkpoint (comma-separated roles: a team game's side)")
    p.add_argument("--league", nargs="+", metavar="RUN_OR_CHECKPOINT", help="self-play games: a round robin of these checkpoints "
                   "(a run directory: each of its checkpoints; 'random': the random-legal-move player), --episodes games per "
                   "pairing of roles or, in a team game, of sides (default 100), both seats; writes league.json (openskill ratings, win/draw/loss of every "
                   "pair, invalid-move rates) and league.png (rating against training iteration) to --output_dir")
    p.add_argument("--output_dir", help="where summary.json and transcripts.jsonl go (default: <run dir>/eval/steps_<N>[-base_model]/"
                   "<split>-n<N> or <split>-episodes<E>)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(lambda: evaluate_from_args(args))


def evaluate_from_args(args: argparse.Namespace) -> int:
    if args.league:
        if args.load_path or args.versus_random or args.versus_checkpoint:
            raise ValueError("--league names its members itself: give it without --load_path, --versus_random or --versus_checkpoint")
        if args.episodes is not None and args.episodes < 1:
            raise ValueError("--episodes must be at least 1")
        output_dir = args.output_dir or str(Path("results") / "league" / time.strftime("%Y%m%d-%H%M%S"))
        print(json.dumps(league(args.league, episodes=args.episodes or 100, seed=args.seed, output_dir=output_dir), indent=2), flush=True)
        return 0
    if args.load_path is None:
        raise ValueError("--load_path is required (a checkpoint or a run directory); with --base_model its config is used without its adapters")
    if args.n < 1 or (args.episodes is not None and args.episodes < 1) or (args.n_eval_threads is not None and args.n_eval_threads < 1):
        raise ValueError("--n, --episodes and --n_eval_threads must be at least 1")
    if args.episodes is not None and (args.n != 1 or args.k is not None):
        raise ValueError("--episodes plays that many episodes in all; --n and --k (samples per task, pass@k) go without it")
    load_path = chosen_checkpoint("marft eval", args.load_path, args.checkpoint)
    config, _ = checkpoint_config(load_path)
    if args.device:
        config.model.device = args.device
    if args.generation_backend:
        config.model.generation_backend = args.generation_backend
    if args.env_name:
        config.env.env_name = args.env_name
    if args.dataset_path:
        config.env.eval_dataset_path = args.dataset_path
    if args.n_eval_threads is not None:
        config.runner.n_eval_threads = args.n_eval_threads
    summary = evaluate(load_path, config=config, n=args.n, k=args.k or [1], episodes=args.episodes, greedy=args.greedy,
                       output_dir=args.output_dir, seed=args.seed, base_model=args.base_model, split=args.split,
                       versus_random=args.versus_random, versus_checkpoint=args.versus_checkpoint, versus_role=args.versus_role)
    print(json.dumps(summary, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
