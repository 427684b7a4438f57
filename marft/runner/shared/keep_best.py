"""The runner's keep_best phase: the moving training accuracy goes to the best tracker
(:class:`~marft.runner.shared.best.BestTracker`); a new best is saved as ``checkpoints/best``; a collapse is warned
about, stops the run, or is rolled back (``--on_collapse``); at the end the best checkpoint's held-out accuracy is
measured if no evaluation did. Functions of the :class:`~marft.runner.shared.runner.Runner` they act on."""

from __future__ import annotations

import logging

from marft.runner.shared.checkpoint import BEST, load_checkpoint, set_trainable_weights, trainable_weights

logger = logging.getLogger(__name__)


def keep_best(runner, iteration: int, accuracy: float) -> None:
    """Feed the iteration's training accuracy (the mean over processes) to the best tracker: write
    ``checkpoints/best`` at a new best, and at a collapse warn, stop or roll back (``--on_collapse``)."""
    writer = runner.writer
    accuracy = runner.log.over_processes({"accuracy": accuracy}).get("accuracy", float("nan"))
    judgement = runner.best.observe(iteration + 1, accuracy)
    if judgement.moving_accuracy == judgement.moving_accuracy:
        writer.add_scalar("charts/moving_accuracy", judgement.moving_accuracy, iteration + 1)
    if judgement.new_best:
        anchor_at_best(runner, iteration)
        runner.save(iteration + 1, name=BEST)
        writer.add_scalar("charts/best_moving_accuracy", runner.best.best.moving_accuracy, iteration + 1)
    if not judgement.collapsed:
        return
    rc, best = runner.config.runner, runner.best.best
    writer.add_scalar("counters/collapses", runner.best.collapses, iteration + 1)
    message = (f"collapse after iteration {iteration + 1}: the moving training accuracy ({rc.collapse_window} iterations) is "
               f"{judgement.moving_accuracy:.3f}, {best.moving_accuracy - judgement.moving_accuracy:.3f} below its best "
               f"{best.moving_accuracy:.3f} at iteration {best.iteration}, kept in {runner.checkpoint_dir / BEST}")
    if rc.on_collapse == "warn":
        logger.warning("%s; training goes on (--on_collapse warn)", message)
    elif rc.on_collapse == "stop":
        logger.warning("%s; the run stops here (--on_collapse stop)", message)
        runner.stopped_by_collapse = True
    else:
        runner.roll_back(iteration, message)


def anchor_at_best(runner, iteration: int) -> None:
    """``--anchor_best_at``: at a new best whose moving accuracy reaches it, each KL reference becomes its policy
    adapter as it is now (the best), counted (``counters/reference_refreshes``). Nothing without frozen references
    (``--kl_reference base``, ``--kl_coef 0``)."""
    threshold, team = runner.config.runner.anchor_best_at, runner.team
    if threshold is None or not team.reference_adapters or runner.best.best.moving_accuracy < threshold:
        return
    for adapter, reference in team.reference_adapters.items():
        team.bank.copy_weights(adapter, reference)
    counters = runner.trainer.counters
    counters["reference_refreshes"] = counters.get("reference_refreshes", 0) + 1
    runner.writer.add_scalar("counters/reference_refreshes", counters["reference_refreshes"], iteration + 1)


def roll_back(runner, iteration: int, message: str) -> None:
    """``--on_collapse rollback``: the best checkpoint's adapters, critic and optimizer states come back, each
    KL reference becomes the policy adapter as it is now (a fresh reference: the run is not pulled back to where
    it started), and every learning rate is scaled by ``--rollback_lr_factor`` for the rest of the run. The
    envs, RNG streams and counters go on; the rollback is counted (``counters/rollbacks``)."""
    team, trainer = runner.team, runner.trainer
    load_checkpoint(runner.checkpoint_dir / BEST, team, trainer, rollback=True)
    for adapter, reference in team.reference_adapters.items():
        team.bank.copy_weights(adapter, reference)
    trainer.lr_factor *= runner.config.runner.rollback_lr_factor
    trainer.counters["rollbacks"] = trainer.counters.get("rollbacks", 0) + 1
    runner.best.rolled_back()
    runner.writer.add_scalar("counters/rollbacks", trainer.counters["rollbacks"], iteration + 1)
    reference = "each KL reference is now the best policy" if team.reference_adapters else "the KL reference stays the base model"
    logger.warning("%s; rolled back to it (--on_collapse rollback): %s, learning rates x%.3g from here", message, reference, trainer.lr_factor)


def evaluate_best(runner) -> dict:
    """The best tracker's figures for the summary. The best checkpoint's held-out accuracy, when no evaluation
    measured it yet, is measured now on the evaluation's episodes; the team then gets its final weights back."""
    best_dir = runner.checkpoint_dir / BEST
    tracker = runner.best
    has_best = tracker.best.iteration > 0 and runner.dist.broadcast_object(best_dir.exists())
    if has_best and tracker.best.heldout_accuracy is None:
        final = trainable_weights(runner.team)
        load_checkpoint(best_dir, runner.team, runner.trainer, rollback=True, load_optimizers=False)
        result = runner.evaluate()
        set_trainable_weights(runner.team, final)  # the team leaves the run with its final policy
        tracker.best.heldout_accuracy = result["accuracy"]
        runner.writer.add_scalar("eval/best_accuracy", result["accuracy"], tracker.best.iteration)
    return {**tracker.summary(), "best_checkpoint": str(best_dir) if has_best else None,
            "stopped_by_collapse": runner.stopped_by_collapse}
