"""``marft export``: a checkpoint's team to a self-contained folder (:func:`marft.trained.export.export`)."""

from __future__ import annotations

from marft.cli.common import add_checkpoint_flags, chosen_checkpoint, parser, run
from marft.trained.export import export


def main(argv: list[str] | None = None) -> int:
    p = parser("marft export", "Export a trained team: one PEFT adapter folder per role, team.json and a model card.")
    add_checkpoint_flags(p)
    p.add_argument("--output_dir", required=True, help="a new (or empty) folder")
    p.add_argument("--merge", action="store_true", help="also save each role's adapter merged into a full copy of the base model")
    p.add_argument("--device", help="where to load the team to export it (default: the run's device)")
    args = p.parse_args(argv)

    def job() -> int:
        out = export(chosen_checkpoint("marft export", args.load_path, args.checkpoint), args.output_dir, merge=args.merge, device=args.device)
        print(f"exported to {out} (team.json, README.md, one adapter folder per role)", flush=True)
        return 0

    return run(job)


if __name__ == "__main__":
    raise SystemExit(main())
