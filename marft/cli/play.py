"""``marft play``: a trained team answers one problem, printed turn by turn (:func:`marft.trained.play.play`)."""

from __future__ import annotations

import sys

from marft.cli.common import add_checkpoint_flags, chosen_checkpoint, parser, run
from marft.trained.evaluate import checkpoint_config
from marft.trained.play import play


def main(argv: list[str] | None = None) -> int:
    p = parser("marft play", "Watch a trained team answer one problem: every turn, labelled with its role.")
    p.add_argument("problem", nargs="?", help="the problem (default: read from stdin)")
    add_checkpoint_flags(p)
    p.add_argument("--base_model", action="store_true", help="the untrained team (fresh adapters) of the checkpoint's config")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (default: the run's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    def job() -> int:
        problem = args.problem if args.problem is not None else sys.stdin.read()
        if not problem.strip():
            raise ValueError("the problem is empty: give the team a question (an argument or stdin)")
        load_path = chosen_checkpoint("marft play", args.load_path, args.checkpoint)
        config, _ = checkpoint_config(load_path)
        if args.device:
            config.model.device = args.device
        print(f"Problem: {problem.strip()}", flush=True)
        play(problem, load_path, config=config, seed=args.seed, base_model=args.base_model,
             show=lambda role, text: print(f"{role}: {text}", flush=True))
        return 0

    return run(job)


if __name__ == "__main__":
    raise SystemExit(main())
