"""Flag validation: one table of rules, applied to every field of every config dataclass.

Each field is checked twice over, before anything loads:

* by its **type hint** (read from the dataclass): an ``int`` field holds an integer (not a bool), a ``float``
  field a finite real number (never NaN or inf), a ``str`` a non-empty string, a ``bool`` a bool; ``Optional[X]``
  also takes None (and, for strings, an empty one);
* by its **rule** in :data:`RULES` (the allowed range), which ``--help`` shows after the field's text.

Every numeric field must have a rule (a test fails otherwise), so a new flag cannot slip in unchecked.
Values a rule accepts are accepted on purpose; "huge" values of sizes and counts (``--num_env_steps``,
``--n_rollout_threads``, ``--lora_r`` ...) are accepted: they are legal, and what they cost is time and memory.

Checks that need more than one field (``TrainConfig.check``), the machine (:func:`check_device`) or the
file system (:func:`check_output_dir`) sit beside these, and run in ``marft.launch.validate``.
This module imports no torch at import time (the config module, a leaf, imports it).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints


@dataclass(frozen=True)
class Range:
    """The allowed values of a numeric field: ``low <= value <= high``, either end open or absent."""

    low: float | None = None
    """Smallest allowed value (None: no bound)."""
    high: float | None = None
    """Largest allowed value (None: no bound)."""
    low_open: bool = False
    """Exclude ``low`` itself (``value > low``)."""
    high_open: bool = False
    """Exclude ``high`` itself (``value < high``)."""

    def accepts(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True

    def describe(self) -> str:
        """``"> 0"``, ``">= 1"``, ``"in [0, 1)"`` ..."""
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_num(self.high)}"
        return "any value"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


POSITIVE = Range(0, low_open=True)
AT_LEAST_1 = Range(1)
NON_NEGATIVE = Range(0)
UNIT = Range(0, 1)
"""[0, 1]: discounts and GAE lambdas."""
MAX_SEED = 2**31 - 1
"""numpy seeds must be below 2**32, and each process seeds with ``seed + rank``."""

RULES: dict[str, Range] = {
    # model
    "n_agents": AT_LEAST_1, "lora_r": AT_LEAST_1, "lora_alpha": AT_LEAST_1, "lora_dropout": Range(0, 1, high_open=True),
    "max_new_tokens": AT_LEAST_1, "context_window": Range(2), "temperature": POSITIVE, "top_k": NON_NEGATIVE,
    "max_logits_mib": NON_NEGATIVE,
    "vllm_gpu_memory_utilization": Range(0, 1, low_open=True), "vllm_cpu_kv_cache_gib": AT_LEAST_1,
    # env
    "horizon": AT_LEAST_1, "max_turns": AT_LEAST_1, "invalid_move_penalty": NON_NEGATIVE,
    # algo
    "group_size": AT_LEAST_1, "opponent_refresh": AT_LEAST_1, "credit_discount": Range(0, 1, low_open=True), "kl_coef": NON_NEGATIVE, "lr": POSITIVE,
    "critic_lr": POSITIVE, "ppo_epoch": AT_LEAST_1, "num_mini_batch": AT_LEAST_1, "gradient_cp_steps": AT_LEAST_1, "max_chunk_tokens": AT_LEAST_1, "max_chunk_mib": NON_NEGATIVE,
    "clip_param": Range(0, 1, low_open=True, high_open=True), "clip_param_high": POSITIVE, "value_clip_param": NON_NEGATIVE, "huber_delta": POSITIVE, "value_loss_coef": NON_NEGATIVE,
    "entropy_coef": NON_NEGATIVE, "target_entropy": POSITIVE, "entropy_coef_step": NON_NEGATIVE, "max_grad_norm": POSITIVE, "gamma": UNIT, "gae_lambda": UNIT, "token_gamma": UNIT,
    "token_gae_lambda": UNIT, "target_kl": POSITIVE, "max_update_kl": POSITIVE, "warmup_steps": NON_NEGATIVE, "lr_warmup_iterations": NON_NEGATIVE, "agent_iteration_interval": NON_NEGATIVE,
    "max_consecutive_skips": NON_NEGATIVE, "rollout_correction_cap": Range(1, low_open=True),
    # runner
    "n_rollout_threads": AT_LEAST_1, "episode_length": AT_LEAST_1, "num_env_steps": AT_LEAST_1, "seed": Range(0, MAX_SEED),
    "save_interval": NON_NEGATIVE, "save_every_minutes": NON_NEGATIVE, "log_interval": NON_NEGATIVE,
    "eval_interval": NON_NEGATIVE, "eval_episodes": AT_LEAST_1, "n_eval_threads": AT_LEAST_1, "keep_checkpoints": NON_NEGATIVE,
    "dist_timeout_s": POSITIVE, "collapse_window": AT_LEAST_1, "collapse_drop": Range(0, 1, low_open=True),
    "rollback_lr_factor": Range(0, 1, low_open=True), "anchor_best_at": Range(0, 1),
    # sft (marft.sft.SFTConfig)
    "n_demonstrations": AT_LEAST_1, "recovery_share": UNIT, "sft_steps": AT_LEAST_1, "sft_batch_size": AT_LEAST_1, "sft_lr": POSITIVE,
}
"""Field name → its allowed range (field names are unique over all sections: each is one ``--flag``)."""


def _base_type(hint: Any) -> tuple[Any, bool]:
    """``(X, optional)`` for a hint ``X`` or ``Optional[X]``."""
    args = getattr(hint, "__args__", None)
    if args and type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return hint, False


def check_value(name: str, hint: Any, value: Any) -> None:
    """Check one field's ``value`` against its type ``hint`` and its rule.

    Raises:
        ValueError: one line naming ``--name``, what it must be and the value given.
    """
    kind, optional = _base_type(hint)
    if value is None:
        if optional:
            return
        raise ValueError(f"--{name} must be given a value, got None")
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"--{name} must be true or false, got {value!r}")
        return
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"--{name} must be a string, got {value!r}")
        if not value.strip() and not optional:
            raise ValueError(f"--{name} must not be empty")
        return
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"--{name} must be an integer, got {value!r}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"--{name} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"--{name} must be a finite number, got {value!r}")
    else:
        return
    rule = RULES.get(name)
    if rule is not None and not rule.accepts(value):
        raise ValueError(f"--{name} must be {rule.describe()}, got {value!r}")


def check_fields(obj) -> None:
    """Check every field of the dataclass instance ``obj`` (its ``__post_init__`` calls this first).

    Raises:
        ValueError: the first field whose value breaks its type or rule.
    """
    hints = get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        check_value(f.name, hints[f.name], getattr(obj, f.name))


def numeric_fields(cls) -> list[str]:
    """Names of ``cls``'s int and float fields (Optional included; bools are not numbers here)."""
    hints = get_type_hints(cls)
    return [f.name for f in dataclasses.fields(cls) if _base_type(hints[f.name])[0] in (int, float)]


def rule_text(name: str) -> str:
    """What ``--help`` adds after a field's text: ``" [> 0]"``, or nothing for fields without a rule."""
    rule = RULES.get(name)
    return f" [{rule.describe()}]" if rule is not None else ""


# ---------------------------------------------------------------------- the machine and the file system
def check_device(device: str) -> None:
    """``--device`` names a device this machine has.

    Raises:
        ValueError: one line: the device does not exist here (and what to use instead).
    """
    import torch

    if device == "auto":
        return
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"--device {device!r} is not a torch device; use auto, cpu, cuda or cuda:N") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: this machine has no usable CUDA GPU (torch {torch.__version__}, "
                             f"torch.cuda.is_available() is False); use --device cpu (or auto)")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), cuda:0 .. "
                             f"cuda:{torch.cuda.device_count() - 1}")
    elif parsed.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"--device {device}: MPS is not available on this machine; use --device cpu (or auto)")
    elif parsed.type != "cpu":
        raise ValueError(f"--device {device}: only auto, cpu, cuda[:N] and mps are supported")


def check_output_dir(output_dir: str | None) -> None:
    """``--output_dir`` is (or can become) a folder this process can write in (:func:`check_writable_folder`)."""
    if output_dir:
        check_writable_folder("--output_dir", output_dir)


def check_writable_folder(flag: str, folder: str | Path) -> None:
    """``folder`` is a folder this process can write in, or one it can create: a file is created and removed in
    it, or in its nearest existing parent. A real write, because ``os.access`` answers yes to root on a read-only
    file system or on ``/sys``, and the run would die on its first save, after the model has loaded.

    Raises:
        ValueError: it is a file, a parent is a file, or nothing can be written there; the message names ``flag``,
            the path and the operating system's reason.
    """
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} exists and is not a folder")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".marft-write-check-"):
            pass
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot write in {existing}: {error.strerror or error}") from None
