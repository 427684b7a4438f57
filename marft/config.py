"""Run configuration: one dataclass per concern, filled from command-line flags.

Every field carries a docstring; :func:`build_parser` turns those docstrings into
``--help`` texts, so the flags and their documentation can never drift apart.
Flag names follow the original MARFT launch script (``--algorithm_name``,
``--n_rollout_threads``, ``--episode_length`` ...) so existing scripts keep working.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Optional, get_type_hints


@dataclass
class ModelConfig:
    """The base model, the agents' adapters and how they generate."""

    model_name_or_path: str = "marft-tiny"
    """Local Hugging Face model directory or hub name; ``marft-tiny`` builds (once) and uses the embedded tiny model."""
    profile_path: str = "reasoner_actor"
    """Agent profile: a JSON file or the name of a shipped profile (see ``marft/envs/profiles/``)."""
    n_agents: int = 2
    """Number of agents in the team; must match the profile."""
    shared_lora: bool = False
    """Give all agents one shared LoRA adapter instead of one adapter per agent."""
    lora_r: int = 8
    """LoRA rank of every adapter (agents and critic)."""
    lora_alpha: int = 16
    """LoRA scaling numerator (scale = lora_alpha / lora_r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA path; keep 0 so rollout and update log-probs agree."""
    lora_target_modules: str = "all-linear"
    """Comma-separated module names to adapt, or ``all-linear``."""
    max_new_tokens: int = 16
    """Longest reply an agent may generate in one turn, in tokens."""
    context_window: int = 512
    """Longest prompt + reply in tokens; longer prompts lose history from the left (never the role header)."""
    temperature: float = 1.0
    """Sampling temperature; the PPO log-probs are taken from the same tempered distribution."""
    top_k: int = 0
    """Sample only among the k most likely tokens (0: off); log-probs are renormalised over those k."""
    trust_remote_code: bool = False
    """Allow custom model code from the model directory (off unless asked)."""
    dtype: str = "float32"
    """Parameter dtype of the base model: float32, bfloat16 or float16."""
    device: str = "auto"
    """Torch device: ``auto`` picks cuda when available, else cpu."""

    def __post_init__(self):
        if self.n_agents < 1:
            raise ValueError(f"--n_agents must be at least 1, got {self.n_agents}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.context_window <= self.max_new_tokens:
            raise ValueError(
                f"--context_window ({self.context_window}) must exceed --max_new_tokens ({self.max_new_tokens})"
            )
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be positive, got {self.temperature}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype!r}")


@dataclass
class EnvConfig:
    """The environment the team acts in."""

    env_name: str = "math"
    """Registered environment name (``marft.envs.make``)."""
    dataset_path: str = "arithmetic"
    """Training problems: a JSON/JSONL file, or ``arithmetic`` for the generated dataset."""
    eval_dataset_path: Optional[str] = None
    """Held-out problems for evaluation; default: the test split of ``dataset_path``."""
    horizon: int = 1
    """Team steps per episode: after a wrong answer the judge asks the team to try again, up to this many times."""

    def __post_init__(self):
        if self.horizon < 1:
            raise ValueError(f"--horizon must be at least 1, got {self.horizon}")


@dataclass
class AlgoConfig:
    """Multi-agent PPO hyperparameters."""

    algorithm_name: str = "APPO"
    """APPO: action-level MAPPO (MARFT-A), a whole reply is one action; TPPO: token-level (MARFT-T), each token is one."""
    lr: float = 1e-3
    """Learning rate of the agents' adapters."""
    critic_lr: float = 1e-3
    """Learning rate of the critic (its adapter and value head)."""
    ppo_epoch: int = 2
    """Passes over each rollout batch per update."""
    num_mini_batch: int = 1
    """Minibatches each rollout batch is split into per epoch (one optimizer step each)."""
    gradient_cp_steps: int = 1
    """Gradient accumulation: each agent's minibatch is processed in this many chunks to save memory (the critic's, which holds every agent's turns, in n_agents times as many)."""
    clip_param: float = 0.2
    """PPO ratio clip range."""
    value_clip_param: float = 0.2
    """Value clip range around the rollout values (0: no value clipping)."""
    use_huber_loss: bool = False
    """Use a Huber value loss instead of the squared error."""
    huber_delta: float = 10.0
    """Huber loss threshold."""
    value_loss_coef: float = 1.0
    """Weight of the value loss."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (mean token entropy of the reply)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (per optimizer)."""
    gamma: float = 0.99
    """Discount per agent turn along the agent chain."""
    gae_lambda: float = 0.95
    """GAE lambda along the agent chain."""
    token_gamma: float = 1.0
    """TPPO: discount between consecutive tokens of one reply (1.0 keeps a long reply's final reward whole)."""
    token_gae_lambda: float = 1.0
    """TPPO: GAE lambda between consecutive tokens of one reply."""
    normalize_advantages: bool = True
    """Standardise advantages over each trained agent's batch."""
    normalization_mode: str = "sum"
    """How a reply's log-prob is formed from its tokens: sum, token (mean per token) or word (sum / words)."""
    target_kl: Optional[float] = None
    """Stop an agent's remaining PPO epochs once its approximate KL exceeds this (None: never). Stops are counted."""
    warmup_steps: int = 0
    """Train only the critic for this many first iterations."""
    agent_iteration_interval: int = 0
    """Train one agent at a time for this many iterations each, round-robin (0: all agents every iteration)."""
    max_consecutive_skips: int = 10
    """Stop training (pointing to the last good checkpoint) once one optimizer has skipped this many minibatches in a row for a non-finite loss or gradient (0: never stop)."""

    def __post_init__(self):
        if self.algorithm_name not in ("APPO", "TPPO"):
            raise ValueError(f"--algorithm_name must be APPO or TPPO, got {self.algorithm_name!r}")
        if self.normalization_mode not in ("sum", "token", "word"):
            raise ValueError(f"--normalization_mode must be sum, token or word, got {self.normalization_mode!r}")
        for name in ("ppo_epoch", "num_mini_batch", "gradient_cp_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.agent_iteration_interval < 0:
            raise ValueError(f"--agent_iteration_interval must be >= 0, got {self.agent_iteration_interval}")
        if self.max_consecutive_skips < 0:
            raise ValueError(f"--max_consecutive_skips must be >= 0, got {self.max_consecutive_skips}")


@dataclass
class RunnerConfig:
    """Rollout sizes, schedule, logging, evaluation and checkpoints."""

    n_rollout_threads: int = 16
    """Parallel environments per rollout."""
    episode_length: int = 2
    """Team steps collected from every environment per training iteration."""
    num_env_steps: int = 4096
    """Total environment steps (threads x steps) to train for."""
    seed: int = 0
    """Seed of torch, numpy, python and the environments."""
    output_dir: Optional[str] = None
    """Run directory; default ``results/<experiment_name>/<timestamp>``."""
    experiment_name: str = "marft"
    """Name used for the default run directory."""
    save_interval: int = 0
    """Save a checkpoint every this many iterations (0: only at the end)."""
    log_interval: int = 1
    """Write TensorBoard scalars every this many iterations."""
    eval_interval: int = 0
    """Evaluate on held-out problems every this many iterations (0: only before and after training)."""
    eval_episodes: int = 200
    """Held-out episodes per evaluation; with more episodes than test problems, problems are revisited."""
    n_eval_threads: int = 50
    """Parallel environments during evaluation."""
    load_path: Optional[str] = None
    """Resume from a ``checkpoints/steps_<N>`` folder, or from a run directory's latest complete checkpoint; flags not given are taken from the checkpoint's config."""
    keep_checkpoints: int = 0
    """Keep only the newest this many checkpoints, deleting older ones after each save (0: keep all)."""

    def __post_init__(self):
        for name in ("n_rollout_threads", "episode_length", "n_eval_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if self.keep_checkpoints < 0:
            raise ValueError(f"--keep_checkpoints must be >= 0, got {self.keep_checkpoints}")


@dataclass
class TrainConfig:
    """Everything one training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)

    @property
    def num_iterations(self) -> int:
        """Training iterations (computed): one rollout batch and one update each."""
        return max(1, self.runner.num_env_steps // (self.runner.episode_length * self.runner.n_rollout_threads))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        return cls(
            model=ModelConfig(**data["model"]),
            env=EnvConfig(**data["env"]),
            algo=AlgoConfig(**data["algo"]),
            runner=RunnerConfig(**data["runner"]),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


SECTIONS = {"model": ModelConfig, "env": EnvConfig, "algo": AlgoConfig, "runner": RunnerConfig}


def field_docs(cls) -> dict[str, str]:
    """The docstring written under each dataclass field, read from the source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _flag_type(hint: Any):
    """The argparse converter for a field's type hint (Optional[X] becomes X, 'none' → None)."""
    args = getattr(hint, "__args__", None)
    if args and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        convert = _flag_type(inner)
        return lambda text: None if text.lower() == "none" else convert(text)
    if hint is bool:
        return _parse_bool
    return hint


def build_parser(description: str = "Train an LLM agent team with multi-agent PPO.") -> argparse.ArgumentParser:
    """One flag per config field, grouped by section, help text from the field docstrings."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section, cls.__doc__)
        docs = field_docs(cls)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kwargs = dict(dest=f"{section}.{f.name}", type=_flag_type(hints[f.name]), default=f.default, help=docs.get(f.name, ""))
            if hints[f.name] is bool:
                kwargs["nargs"] = "?"
                kwargs["const"] = True
            group.add_argument(f"--{f.name}", **kwargs)
    return parser


def parse_config(argv: Optional[list[str]] = None) -> tuple[TrainConfig, set[str]]:
    """Parse flags into a :class:`TrainConfig`; also return the field names given explicitly."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    namespace = parser.parse_args(argv)
    values = {section: {} for section in SECTIONS}
    for key, value in vars(namespace).items():
        section, name = key.split(".", 1)
        values[section][name] = value
    given = {arg[2:].split("=", 1)[0] for arg in argv if arg.startswith("--")}
    try:
        config = TrainConfig.from_dict(values)
    except ValueError as error:
        parser.error(str(error))
    return config, given
