"""``python -m marft.cli.sft`` / ``python scripts/sft.py``: the supervised warm start of a team from the command line.

Takes every training flag plus the warm-start flags (:class:`marft.sft.SFTConfig`), trains each role's adapter on
its own turns (:func:`marft.sft.warm_start`), and saves ``<run dir>/checkpoints/steps_0`` for ``--load_path``.
"""

from __future__ import annotations

import json
import logging
import sys
import time

from marft.config import SECTIONS, TrainConfig, parse_sections
from marft.faults import CheckpointError, CheckpointWriteError, ExitCode
from marft.launch import build_team, default_run_dir, validate
from marft.runner.shared.checkpoint import save_checkpoint
from marft.sft import (
    SFTConfig,
    demonstrations,
    load_transcripts,
    training_reply_loss,
    turn_examples,
    unlearned_reply_tokens,
    warm_start,
)


def main(argv: list[str] | None = None) -> int:
    """``python scripts/sft.py [training flags] [--sft_data ...]``: warm-start the team, save ``checkpoints/steps_0``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    argv = sys.argv[1:] if argv is None else argv
    values, _, parser = parse_sections(argv, {**SECTIONS, "sft": SFTConfig}, "Supervised warm start of an agent team (SFT before RL).")
    try:
        sft_config = SFTConfig(**values.pop("sft"))
        config = TrainConfig.from_dict(values)
        if config.runner.load_path:
            raise ValueError("--load_path is for RL; the warm start starts from the base model")
        profile, make_train_env, _ = validate(config)
        transcripts, skipped = (
            (demonstrations(make_train_env, sft_config.n_demonstrations, config.runner.seed, sft_config.recovery_share), 0)
            if sft_config.sft_data == "demonstrations" else load_transcripts(sft_config.sft_data)
        )
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    team, trainer = build_team(config, profile)
    try:
        examples = turn_examples(team.prompts, transcripts, eos_id=team.eos_id, max_reply_tokens=config.model.max_new_tokens)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    losses = warm_start(team, examples, sft_config, seed=config.runner.seed)
    train_loss = training_reply_loss(team, examples)
    unlearned = unlearned_reply_tokens(team, examples)
    if unlearned:
        hint = ("; the output layer is frozen and may cap them: try --lora_target_modules all-linear,lm_head"
                if not team.bank.output_layer_adapted else "; more --sft_steps may help")
        logging.getLogger("marft.sft").warning("after the warm start these reply tokens are still unlikely (mean nats): %s%s", unlearned, hint)
    run_dir = default_run_dir(config)
    state = {"iteration": 0, "env_steps": 0, "roles": [spec.role for spec in profile], "next_agents": trainer.agents_to_train(0),
             "counters": dict(trainer.counters), "sft": {"transcripts": len(transcripts), "skipped": skipped, "turns": len(examples),
                                                         "first_loss": losses[0], "last_loss": losses[-1],
                                                         "train_loss": train_loss}}
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(config.to_json())
        checkpoint = save_checkpoint(run_dir / "checkpoints", 0, team, trainer, state, config.to_json())
    except (CheckpointWriteError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.SAVE_FAILED
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitCode.TRAINING_STOPPED
    summary = {**state["sft"], "unlearned_reply_tokens": unlearned, "seconds": round(time.perf_counter() - start, 1), "checkpoint": str(checkpoint)}
    (run_dir / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"warm start done in {summary['seconds']:.0f}s: {len(examples)} turns of {len(transcripts)} transcripts "
          f"({skipped} skipped), reply loss {losses[0]:.3f} -> {losses[-1]:.3f} (last step's batch), {train_loss:.3f} over the "
          f"training turns; start RL with --load_path {checkpoint}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
