"""``marft`` (and ``python -m marft``): one command, a subcommand per job.

    marft train  [flags | --config run.yaml]     train a team (the flags of scripts/train_math.sh)
    marft sft    [flags]                         warm-start a team on transcripts or an env's demonstrations
    marft eval   --load_path CKPT [--n 4 --k 1,4]  pass@k and success on an env's held-out split
    marft export --load_path CKPT --output_dir DIR [--merge]  PEFT adapters per role, team.json, a model card
    marft play   --load_path CKPT "problem"      watch the team answer one problem, turn by turn

Each subcommand's ``--help`` lists its flags; each is a thin layer over a library function
(``marft.train``, ``marft.evaluate``, ``marft.export``, ``marft.play``).
"""

from __future__ import annotations

import sys

SUBCOMMANDS = {
    "train": ("marft.cli.train", "train a team with multi-agent RL"),
    "sft": ("marft.cli.sft", "supervised warm start of a team before RL"),
    "eval": ("marft.cli.eval", "evaluate a checkpoint (or the base model) on a held-out split: pass@k, success, transcripts"),
    "export": ("marft.cli.export", "export a checkpoint's team: PEFT adapters per role, team.json, a model card"),
    "play": ("marft.cli.play", "watch a team answer one problem, turn by turn"),
}
"""Subcommand → (module with ``main(argv) -> int``, one line of help)."""


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    rows = "\n".join(f"  {name.ljust(width)}  {text}" for name, (_, text) in SUBCOMMANDS.items())
    return f"usage: marft <command> [flags]   (marft <command> --help for its flags)\n\ncommands:\n{rows}\n"


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        print(f"error: unknown command {command!r}; one of {', '.join(SUBCOMMANDS)} (see marft --help)", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[command][0])
    program = sys.argv[:1]
    sys.argv[:1] = [f"marft {command}"]  # argparse's usage line names the subcommand
    try:
        return module.run_main(rest) if command == "train" else module.main(rest)
    finally:
        sys.argv[:1] = program


if __name__ == "__main__":
    raise SystemExit(main())
