"""Run configuration: one dataclass per concern, filled from command-line flags.

Every field carries a docstring; :func:`build_parser` turns those docstrings into
``--help`` texts, so the flags and their documentation can never drift apart.
Flag names follow the original MARFT launch script (``--algorithm_name``,
``--n_rollout_threads``, ``--episode_length`` ...) with the original's meanings, units included
(``--agent_iteration_interval`` and ``--warmup_steps`` count environment steps, as there), so
existing scripts keep working. Allowed values of choice flags come from one table each
(:data:`CHOICES`), which ``--help``, validation and the benchmark read.
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

from marft.choices import (
    CHAT_TEMPLATE_MODES,
    CREDIT_MODES,
    CRITIC_INITS,
    CRITIC_MODES,
    DTYPES,
    GAME_VIEWS,
    GENERATION_BACKENDS,
    KL_COEF_DEFAULTS,
    KL_ESTIMATORS,
    KL_REFERENCES,
    LR_SCHEDULES,
    NORMALIZATION_MODES,
    ON_COLLAPSE,
    ROLLOUT_CORRECTIONS,
    TRAINERS,
    WORKFLOWS,
)
from marft.validation import check_fields, rule_text


@dataclass
class ModelConfig:
    """The base model, the agents' adapters and how they generate."""

    model_name_or_path: str = "marft-tiny"
    """Local Hugging Face model directory or hub name; ``marft-tiny`` builds (once) and uses the embedded tiny model (``marft-tiny-instruct``: its instruct twin; ``marft-small``: the same recipe twice as wide)."""
    profile_path: str = "reasoner_actor"
    """Agent profile: a JSON file or the name of a shipped profile (see ``marft/envs/profiles/``)."""
    n_agents: Optional[int] = None
    """Number of agents in the team, an orchestrator included; when given, the profile must have exactly this many (default: the profile's)."""
    shared_lora: bool = False
    """Give all agents one shared LoRA adapter instead of one adapter per agent."""
    critic_mode: str = "shared"
    """shared: one centralized critic adapter and value head values every agent's turns (CTDE); per_agent: one critic adapter and value head per agent, each trained on its own agent's turns only (all on the one base model). Critic-free trainers (GRPO) build none."""
    critic_init: str = "fresh"
    """What the critic starts from when RL starts (a warm start's checkpoint, or no --load_path): fresh (its adapters as they are: after marft sft untrained, so the critic values from the base model's features) or policy (each critic adapter a copy of the policy adapter whose turns it values, as verl and OpenRLHF start the value model from the SFT model; the value head stays new). policy needs one policy adapter per critic adapter (--critic_mode per_agent, --shared_lora, or a one-agent team). Resuming an RL checkpoint keeps its critic either way."""
    lora_r: int = 8
    """LoRA rank of every adapter (agents and critic)."""
    lora_alpha: int = 16
    """LoRA scaling numerator (scale = lora_alpha / lora_r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA path, active in the update only (rollouts, values and scoring run in eval mode); with a non-zero value the first PPO epoch's ratio is no longer exactly 1."""
    lora_target_modules: str = "all-linear"
    """Comma-separated module names to adapt, or ``all-linear`` (every linear layer but the output layer); ``all-linear,lm_head`` adapts the output layer too, which a reply needs when its tokens are ones the base model never learned to output (the embedded models' ``[`` and ``]``: a game's moves)."""
    max_new_tokens: int = 16
    """Longest reply an agent may generate in one turn, in tokens."""
    context_window: int = 512
    """Longest prompt + reply in tokens; longer prompts lose history from the left (never the role header; an opening the environment keeps, such as a game's rules, stays when it takes at most half of the room; warned once per run)."""
    temperature: float = 1.0
    """Sampling temperature; the PPO log-probs are taken from the same tempered distribution."""
    chat_template: str = "auto"
    """auto: when the tokenizer has a chat template (instruct models), render each agent's prompt with it: system = the agent's role prompt, one user message = its private observation and the shared conversation followed by "Now it is <Role>'s turn.", the reply = the assistant turn, ended by the tokenizer's eos_token_id (check it is the template's end of turn, <|im_end|> for Qwen2.5-Instruct); a tokenizer without one (the embedded marft-tiny) gets the plain transcript. none: always the plain transcript (role prompt, private observation, conversation, cue "<Role>:")."""
    generation_backend: str = "decode_loop"
    """What samples the replies: decode_loop (marft's own sampling loop on the KV cache, without generate's logits processors and stopping criteria: on CPU the same ids and log-probs as generate for a seed, and faster on small models, see Benchmarks), generate (transformers' model.generate, the reference and fallback) or vllm (one colocated vLLM engine, each agent's adapter served as a LoRA and re-sent after each update that changed it; the PPO log-probs still come from the trainer's forward; needs vLLM installed, see Scaling)."""
    vllm_gpu_memory_utilization: float = 0.3
    """--generation_backend vllm on a GPU: the share of the GPU's memory the engine may take (weights and KV cache); the trainer needs the rest."""
    vllm_sleep: bool = True
    """--generation_backend vllm on a GPU: the engine frees its KV cache while the trainer updates (vLLM's sleep mode, level 1) and takes it back before the next rollout."""
    vllm_cpu_kv_cache_gib: int = 1
    """--generation_backend vllm on CPU: the engine's KV cache in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE; its own default takes most of the machine's memory)."""
    merge_lora_in_rollout: bool = True
    """In the rollout's forward passes without gradient (sampling each agent's replies, the critic's values), fold the adapter in use into temporary copies of the base weights: one matrix product per adapted layer instead of three; the base weights get their original tensors back, bit for bit, after each batch. Costs one copy of the adapted weights meanwhile; rollout log-probs and values equal the update's to float32 rounding. Float32 models only (in half precision the folded update would be rounded away, so there the rollout runs unmerged)."""
    unpadded_forward: bool = True
    """Run the update's forwards, the critic's values and the sampling loop's prompt with each layer's matrix products on the real tokens only (pads are dropped after the embedding and put back only around attention, which needs rows), and decode_loop's steps on a preallocated KV cache. Same results to float32 rounding; Llama-family models (Qwen2/2.5/3, Llama, Mistral without sliding windows) only, others (and the update under --gradient_checkpointing) use transformers' padded forward."""
    share_prompt_openings: bool = False
    """Where many prompts of one agent open alike after the role header (a game's rules or a puzzle's instructions in every prompt), run that opening once per batch as part of the role header, for every forward that shares role headers (the rollout's sampling and values, the update), instead of once in every row; the warm start (marft sft) then runs its turns the same way, instead of whole rows. The batch's rows are grouped by their first L tokens, with L the length that saves the most positions (counting each further group's own copy of the header), and only when it saves at least an eighth of them, so prompts that open differently (one problem per row) run as before. Same results to float32 rounding (a seeded run's draws then differ in the last bits, so it is off unless asked)."""
    top_k: int = 0
    """Sample only among the k most likely tokens (0: off). The PPO log-probs are those of the tempered distribution before truncation (as in TRL), so a token that leaves the top k during the update keeps a finite ratio (counted: counters/out_of_topk_tokens)."""
    max_logits_mib: int = 1024
    """Memory budget (MiB) of the float32 vocabulary logits one scoring forward forms at once (the update's log-probs and entropies, the rollout's scoring of an engine's replies): larger batches are scored a few rows at a time, and under autograd each chunk's logits are recomputed in the backward instead of kept (torch checkpoint). The budget is the size of one chunk's logits tensor; the chunk's peak is a few times it (its log-softmax, exponential and gradients), and a single reply over the budget is a chunk of its own. Matters for large vocabularies (Qwen2.5's 151,936 tokens: ~74 MiB per 128-token reply); a batch within the budget is scored in one pass. Llama-family models (Qwen2/2.5/3, Llama, Mistral); others form all logits at once. 0: no budget."""
    trust_remote_code: bool = False
    """Allow custom model code from the model directory (off unless asked)."""
    dtype: str = "float32"
    """Parameter dtype of the base model."""
    device: str = "auto"
    """Torch device: ``auto`` picks cuda when available, else cpu. With several processes (``torchrun``, ``accelerate launch``) each uses its local GPU: give ``cuda`` or ``auto``, not ``cuda:N``."""
    gradient_checkpointing: bool = False
    """Recompute the base model's layer activations in the backward pass of the update instead of keeping them (less memory for long replies, about one more forward of time)."""

    def __post_init__(self):
        check_fields(self)  # types, finite numbers and ranges (marft.validation.RULES)
        if self.context_window <= self.max_new_tokens:
            raise ValueError(
                f"--context_window ({self.context_window}) must exceed --max_new_tokens ({self.max_new_tokens})"
            )
        check_choice("dtype", self.dtype)
        check_choice("critic_mode", self.critic_mode)
        check_choice("critic_init", self.critic_init)
        check_choice("chat_template", self.chat_template)
        check_choice("generation_backend", self.generation_backend)


@dataclass
class EnvConfig:
    """The environment the team acts in."""

    env_name: str = "math"
    """The environment: a registered name (math, relay_sum, code, route, or one of marft.envs.register), an import path ``package.module:Class`` (its folder on PYTHONPATH), an installed package's ``marft.envs`` entry point, or ``textarena:<game id>`` (a TextArena game, e.g. textarena:TicTacToe-v0, with --profile_path game_player)."""
    dataset_path: Optional[str] = None
    """Training problems, passed to the env: for math a JSON/JSONL file or ``arithmetic`` (the default, generated); for code a DeepCoder-style JSON/JSONL file, ``humaneval`` or ``generated`` (the default). None: the env's own default."""
    eval_dataset_path: Optional[str] = None
    """Held-out problems for evaluation; default: the test split of ``dataset_path``."""
    horizon: int = 1
    """Team steps per episode: after a wrong answer the judge asks the team to try again, up to this many times."""
    workflow: str = "auto"
    """Who speaks when in a team step: auto (what the profile describes), sequential (profile order), graph (the profile's DAG; a layer speaks in parallel) or orchestrated (the profile's orchestrator calls specialists with <call>Role</call> and ends with <done/>)."""
    max_turns: int = 5
    """Orchestrated workflows: the most specialist calls per team step (the step is graded after the last)."""
    invalid_move_penalty: float = 0.0
    """TextArena games: reward charged to an agent, at that move's own step, for each invalid move the game forgives (TextArena lets the player try again once per move, so under its rule, 0, only a second invalid try in a row costs: the game ends, lost). Environments that take no ``invalid_move_penalty`` argument refuse a non-zero value."""

    game_view: str = "since_move"
    """TextArena games: what an agent sees besides the rules: since_move (the messages since its previous move) or board (the latest board on, as TextArena's GameBoardObservationWrapper: one position, one prompt). Environments that take no ``view`` argument refuse board."""

    def __post_init__(self):
        check_fields(self)
        check_choice("workflow", self.workflow)
        check_choice("game_view", self.game_view)


@dataclass
class AlgoConfig:
    """Multi-agent PPO hyperparameters."""

    algorithm_name: str = "APPO"
    """APPO: action-level MAPPO (MARFT-A), a whole reply is one action; TPPO: token-level (MARFT-T), each token is one; GRPO: critic-free, group-relative (no critic at all)."""
    group_size: int = 8
    """GRPO: complete team episodes of the same task per group, at least 2 (the runner resets this many envs on one task; --n_rollout_threads per process must be a multiple). A group whose episodes all fail teaches nothing; more episodes per task make one success in it likelier (docs/algorithms.md, "Why groups of 8")."""
    grpo_scale_rewards: bool = True
    """GRPO: divide each group's centred returns by the group's standard deviation (false: centre only)."""
    credit_assignment: str = "env"
    """How the environment's rewards become each turn's credit: env (as they are, into the agent chain, where a reward also flows back to earlier turns; the original MARFT), equal (every turn of a team step gets the team reward), step_discount (turn n of K gets R x credit_discount^(K-1-n)) or per_step (each turn its own agent's reward). With a critic, each turn's return within its team step is exactly its credit; with GRPO, each agent's turns are compared within the group by their credits."""
    credit_discount: float = 0.9
    """step_discount: the factor per turn between a turn's credit and the next turn's."""
    train_orchestrator: bool = True
    """Orchestrated workflows: train the orchestrator like every agent (false: it keeps its adapter as it is, its turns still count in the critic's data)."""
    frozen_roles: Optional[str] = None
    """Comma-separated roles whose adapters are never trained (none: every role trains): they play with the adapter they start with (from --load_path: a fixed opponent taken from a warm start or a past checkpoint, e.g. one seat of a self-play game or one side of a team game); their turns still count in the critic's data. In a self-play or team game not the profile's first role, whose games the run's accuracy and checkpoints/best follow."""
    opponent: Optional[str] = None
    """Self-play games: checkpoint:PATH plays --opponent_role with its adapter from PATH (a checkpoint or run directory of the same team: base model, profile, LoRA shape), never trained (it joins --frozen_roles), while the other roles train from --load_path or from scratch. pool:K (two-seat games): --opponent_role plays each game with one of the K latest snapshots of the other role's adapter, drawn per game (a snapshot every --opponent_refresh iterations, the oldest replaced; the first is the adapter training starts from), never trained itself. None: every role is the team's own."""
    opponent_role: Optional[str] = None
    """The role played from --opponent (none: the profile's last role, e.g. Player B)."""
    opponent_refresh: int = 10
    """--opponent pool:K: iterations between two snapshots of the trained role's adapter into the pool."""
    kl_coef: Optional[float] = None
    """Weight of the KL penalty to the reference policy (--kl_reference): the k3 estimator per reply token, added to the policy loss in that loss's own units (MARFT-A and GRPO: a reply's KL, its tokens' combined as its log-prob is by --normalization_mode, averaged over each minibatch's replies; MARFT-T and GRPO's token-level loss: averaged over its reply tokens), so every token weighs it against its advantage alike. It keeps the agents near the protocol they start with: without it a team can drift into a private code that no single agent can leave (docs/troubleshooting.md). None (the default): 0.1 for MARFT-A and MARFT-T, 0.0125 for GRPO, whose group-relative advantages are zero on most replies once most groups all solve (docs/algorithms.md). 0: none, no reference forward."""
    kl_reference: str = "auto"
    """The KL penalty's reference policy: base (the base model, adapters off), initial (each agent's adapter as training started, kept frozen: a copy of the adapters, saved in checkpoints) or auto (initial when training starts from --load_path, e.g. a scripts/sft.py warm start; base otherwise). A run records what auto meant, so a resumed run keeps its reference."""
    kl_estimator: str = "k3"
    """The KL term's estimator per reply token: k3 (exp(r) - r - 1, r = log p_ref - log p; as a loss on the policy's own samples its gradient is that of KL(reference || policy), a pull like supervised training on the reference's replies, toward every reply the reference would write) or k2 ((log p - log p_ref)^2 / 2; its gradient is that of KL(policy || reference), the KL of the regularised objective, which lets a policy settle on the replies that pay). Both are r^2 / 2 for small r, so --kl_coef means the same near the reference (docs/algorithms.md)."""
    lr: float = 1e-3
    """Learning rate of the agents' adapters."""
    critic_lr: float = 1e-3
    """Learning rate of the critic (its adapter and value head)."""
    lr_schedule: str = "linear"
    """How the learning rates (--lr, --critic_lr) move over the run: linear (the default: from their values at the first iteration down to 0 after the last, as CleanRL's anneal_lr and on-policy's use_linear_lr_decay) or constant. Advantages are standardised and Adam scales each step to about the learning rate, so at a constant rate the updates stay full-size once the policy is near its optimum and keep its replies' rare slips from dying out; the decay lets them shrink (docs/algorithms.md). The rate of an iteration depends on that iteration and the run's iterations in all (--num_env_steps), so a preempted run resumes exactly; a finished run resumed with a larger --num_env_steps goes on from the rate of its iteration in the longer run."""
    lr_warmup_iterations: int = 0
    """Raise the learning rates (--lr, --critic_lr) linearly over this many first iterations (iteration i at (i + 1) / this of --lr_schedule's rate), as TRL's warmup_steps and verl's lr_warmup_steps. A fresh Adam's first steps move every weight by about the full rate whatever its gradient's size (its second-moment estimate has only those steps' gradients in it); from a sharp warm start (a supervised --load_path) one such step can move the policy by nats per reply, well past PPO's clip, before the clip or the KL penalty can act (docs/algorithms.md). 0 (the default): the full rate from the first iteration."""
    ppo_epoch: int = 2
    """Passes over each rollout batch per update."""
    num_mini_batch: int = 1
    """Minibatches each rollout batch is split into per epoch (one optimizer step each)."""
    gradient_cp_steps: int = 1
    """Gradient accumulation: each agent's minibatch is processed in this many chunks to save memory (the critic's, which holds every agent's turns, in n_agents times as many)."""
    max_chunk_tokens: Optional[int] = None
    """Token budget of one gradient-accumulation chunk: each minibatch chunk (length-sorted rows) is cut further until the positions its forward runs fit: rows x (longest prompt after the shared role header + longest reply), plus each role header once (headers x longest header; without shared headers, e.g. under --gradient_checkpointing, rows x (longest prompt + longest reply)). Peak update memory then follows the budget, not the prompt lengths of later agents nor how long an agent's role header is (a single longer row is its own chunk); each chunk also runs its own role headers (none held over the minibatch; a header forward and backward per chunk, a little more compute). A minibatch the budget does not cut runs as without one (its rows in their shuffled order, each role header run once for all its chunks). None (the default): the budget follows --max_chunk_mib."""
    max_chunk_mib: Optional[int] = None
    """Memory budget (MiB) of the activations one update chunk keeps for its backward; sets the chunk's token budget when --max_chunk_tokens is not given: this memory over an estimate of what one position keeps in the model's decoder layers (8 x hidden + 4 x intermediate float32 values per layer, float32 whatever the model's dtype: peft's adapters and the norms keep float32 inputs; one hidden vector per layer under --gradient_checkpointing; marft.algorithms.chunk_budget). Peak update memory then follows the budget, not the number of agents nor how long later agents' conversations are (a single row longer than the budget is a chunk of its own). None (the default): 1024 on CPU (the same chunks on every machine), a quarter of the GPU's memory on CUDA. 0: no budget (chunks of equal rows)."""
    clip_param: float = 0.2
    """PPO ratio clip range: the ratio is kept within [1 - clip_param, 1 + clip_param_high]."""
    clip_param_high: Optional[float] = None
    """Upper clip range of the PPO ratio (DAPO's clip-higher; None: clip_param)."""
    value_clip_param: float = 0.2
    """Value clip range around the rollout values (0: no value clipping)."""
    values_in_update: bool = True
    """Value the rollout's turns by the update's own first critic forward instead of a critic forward of their own during the rollout, where that is exact and holds no more memory than the update may: one minibatch per epoch (the first epoch's forward then covers every turn before any critic step, and its value clipping compares the values with themselves), no --lora_dropout (the rollout's values have none), one process, and every turn the rollout can hold fitting one chunk of the update's budget (--max_chunk_tokens / --max_chunk_mib, not 0). One critic forward per iteration fewer (its time moves from charts/rollout_seconds to charts/advantages_seconds); values, advantages and updates equal the other way's to float32 rounding. false: the rollout values every turn."""
    use_huber_loss: bool = False
    """Use a Huber value loss instead of the squared error."""
    huber_delta: float = 10.0
    """Huber loss threshold."""
    value_loss_coef: float = 1.0
    """Weight of the value loss."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (mean token entropy of the reply); with target_entropy, its starting value."""
    target_entropy: Optional[float] = None
    """Adaptive entropy control (as Skywork-OR1): keep each adapter's mean token entropy near this many nats by moving its entropy bonus weight up by entropy_coef_step after an update whose entropy fell below the target and down by it (never below 0) after one above. None: the fixed entropy_coef."""
    entropy_coef_step: float = 0.005
    """target_entropy: how much an adapter's entropy bonus weight moves per update."""
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
    """APPO: how a reply's log-prob is formed from its tokens: sum, token (mean per token) or word (sum / words)."""
    rollout_correction: str = "truncate"
    """How the policy loss corrects for replies sampled by an inference engine whose probabilities differ slightly from the trainer's (--generation_backend vllm; with the other backends the two agree and the weight is 1): truncate (each reply weighted by min(trainer/engine probability ratio, --rollout_correction_cap), per token in token-level losses: truncated importance sampling, as TRL and verl offer), mask (replies whose ratio is above the cap or below its inverse get weight 0) or none."""
    rollout_correction_cap: float = 2.0
    """The cap of --rollout_correction (above 1)."""
    target_kl: Optional[float] = None
    """Stop an agent's remaining PPO epochs once its approximate KL exceeds this (None: never). Stops are counted."""
    max_update_kl: Optional[float] = 0.05
    """Bound how far one update moves a policy: after an agent's PPO epochs, the mean KL (k3, per real reply token) between the policy that sampled the batch and the updated one is measured on the batch, and the update's step is halved (up to 6 times, then undone) until it is within this (a backtracking line search; logged as update_kl and update_step_scale, counted as counters/cut_updates and counters/undone_updates). PPO's clip does not bound the first step of an epoch, so a near-deterministic policy can otherwise move far in one update (docs/results/stability.md). none: no bound."""
    warmup_steps: int = 0
    """Train only the critic until this many environment steps are collected (env steps, as in the original MARFT: one iteration is n_rollout_threads x episode_length)."""
    agent_iteration_interval: int = 0
    """Train one agent at a time, switching every this many environment steps, round-robin (0: all agents every iteration). Env steps, as in the original MARFT: its 1000 with 4 envs x 1 step switches every 250 iterations."""
    update_on_constant_rewards: bool = False
    """Update the policies also on a batch that cannot rank replies, as the original MARFT does: all advantages zero, or all rewards equal on episodes that all ended (its advantages are then the critic's errors alone). Default: such a batch trains the critic only and is counted (counters/constant_reward_batches); equal rewards on episodes that go on still train the policies (the bootstrapped values rank the replies)."""
    max_consecutive_skips: int = 10
    """Stop training (pointing to the last good checkpoint) once one optimizer has skipped this many minibatches in a row for a non-finite loss or gradient (0: never stop)."""

    def __post_init__(self):
        check_fields(self)
        check_choice("algorithm_name", self.algorithm_name)
        check_choice("normalization_mode", self.normalization_mode)
        check_choice("rollout_correction", self.rollout_correction)
        check_choice("credit_assignment", self.credit_assignment)
        check_choice("kl_reference", self.kl_reference)
        check_choice("lr_schedule", self.lr_schedule)
        check_choice("kl_estimator", self.kl_estimator)
        if self.algorithm_name == "GRPO" and self.group_size < 2:
            raise ValueError(
                f"--group_size {self.group_size}: GRPO compares each episode with the other episodes of its group, so a group "
                f"of one has no spread, every advantage is 0 and nothing is learned; use --group_size 2 or more (default 8)"
            )

    @property
    def frozen(self) -> list[str]:
        """The roles of ``--frozen_roles``, in order (empty: every role trains)."""
        return [role.strip() for role in (self.frozen_roles or "").split(",") if role.strip()]

    @property
    def effective_kl_coef(self) -> float:
        """The KL penalty's weight in this run: ``kl_coef``, or the algorithm's default (:data:`KL_COEF_DEFAULTS`).
        Resolved when used, not stored: a warm start's config keeps None, so a run from it with another
        ``--algorithm_name`` gets that algorithm's default."""
        return KL_COEF_DEFAULTS[self.algorithm_name] if self.kl_coef is None else self.kl_coef


@dataclass
class RunnerConfig:
    """Rollout sizes, schedule, logging, evaluation and checkpoints."""

    n_rollout_threads: int = 16
    """Parallel environments per rollout."""
    episode_length: int = 2
    """Team steps collected from every environment per training iteration."""
    num_env_steps: int = 16384
    """Total environment steps (threads x steps) to train for. The default is 512 iterations of 16 envs x 2 steps, the
    length the quick start's math team needs to reach its plateau with the learning rates' decay (docs/algorithms.md)."""
    seed: int = 0
    """Seed of torch, numpy, python and the environments."""
    output_dir: Optional[str] = None
    """Run directory; default ``results/<experiment_name>/<timestamp>``."""
    experiment_name: str = "marft"
    """Name used for the default run directory."""
    save_interval: int = 0
    """Save a checkpoint every this many iterations (0: by --save_every_minutes alone); one is always saved at the end."""
    save_every_minutes: float = 10.0
    """Also save a checkpoint at the end of the first iteration after this many minutes since the last save (or the start), so a run stopped from outside (preemption, kill) loses at most that much work (0: off). Saving only adds checkpoints: training results are the same."""
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
    keep_checkpoints: int = 2
    """Keep only the newest this many checkpoints, deleting older ones after each complete save (0: keep all); the newest, complete one is never deleted."""
    on_collapse: str = "rollback"
    """What a run does when its moving training accuracy (the mean over --collapse_window iterations) falls --collapse_drop or more below its best: warn (log a warning naming checkpoints/best), stop (save and end the run) or rollback (reload checkpoints/best's adapters, critic and optimizers, make them the KL reference, scale the learning rates by --rollback_lr_factor, train on; counted as counters/rollbacks). Whatever this says, every run keeps checkpoints/best, the policy of its best moving training accuracy (docs/runs.md)."""
    collapse_window: int = 20
    """Iterations in the moving training accuracy that picks checkpoints/best and judges a collapse (a collapse is judged on a full window after the best)."""
    collapse_drop: float = 0.15
    """How far (absolute accuracy) the moving training accuracy must fall below its best to count as a collapse."""
    rollback_lr_factor: float = 0.5
    """--on_collapse rollback: the learning rates (--lr, --critic_lr) are multiplied by this at each rollback, for the rest of the run."""
    anchor_best_at: Optional[float] = None
    """Once the moving training accuracy reaches this (0-1), each new best policy becomes the KL reference of its adapter (--kl_reference initial, or a warm start): the KL penalty then anchors the policy at the best it reached instead of pulling it back toward where training started (counted as counters/reference_refreshes). None: the reference stays where it started (rollbacks still refresh it)."""
    continue_on_save_error: bool = False
    """When a checkpoint cannot be written (disk full, quota, any write error): warn and train on (default: stop cleanly, exit code 74); the partial folder is removed either way."""
    dist_timeout_s: float = 300.0
    """With several processes: seconds a collective waits for the others before failing, so a dead or stuck process stops the run with an error instead of a hang (the first collective also waits for the model to load)."""

    def __post_init__(self):
        check_fields(self)
        check_choice("on_collapse", self.on_collapse)


@dataclass
class TrainConfig:
    """Everything one training run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)

    def check(self) -> None:
        """Checks across sections (each section checks itself in ``__post_init__``); run once the config is final,
        after a resume merged the checkpoint's values.

        Raises:
            ValueError: ``num_env_steps`` is less than one iteration's env steps; ``agent_iteration_interval`` is shorter than one iteration's env steps; with GRPO,
                ``group_size`` does not divide ``n_rollout_threads`` or ``horizon`` does not divide ``episode_length``;
                ``credit_assignment own_turns`` with another algorithm than APPO or TPPO, or ``horizon`` not dividing ``episode_length``.
        """
        if self.algo.algorithm_name == "GRPO":
            groups, horizon = self.algo.group_size, self.env.horizon
            if self.runner.n_rollout_threads % groups:
                envs = self.runner.n_rollout_threads
                largest = max((g for g in range(2, envs + 1) if envs % g == 0), default=None)  # the largest group that fits
                raise ValueError(
                    f"--group_size {groups} must divide --n_rollout_threads {envs} (each group is that many envs on one task): "
                    f"use --n_rollout_threads {(envs // groups + 1) * groups}" + (f" or --group_size {largest}" if largest else "")
                )
            if self.runner.episode_length % horizon:
                raise ValueError(
                    f"GRPO plays whole episodes: --episode_length {self.runner.episode_length} must be a multiple of --horizon {horizon} "
                    f"(each iteration plays episode_length / horizon rounds of group episodes)"
                )
        if self.algo.credit_assignment == "own_turns":
            if self.algo.algorithm_name not in ("APPO", "TPPO"):
                raise ValueError(f"--credit_assignment own_turns (each agent's own chain of turns, for self-play) trains with "
                                 f"--algorithm_name APPO or TPPO, not {self.algo.algorithm_name} (GRPO self-play: --credit_assignment per_step)")
            if self.runner.episode_length % self.env.horizon:
                raise ValueError(f"--credit_assignment own_turns plays whole episodes: --episode_length {self.runner.episode_length} "
                                 f"must be a multiple of --horizon {self.env.horizon}")
        interval, per_iteration = self.algo.agent_iteration_interval, self.steps_per_iteration
        if self.runner.num_env_steps < per_iteration:
            raise ValueError(
                f"--num_env_steps {self.runner.num_env_steps} is less than one iteration: one iteration collects {per_iteration} "
                f"environment steps (--n_rollout_threads {self.runner.n_rollout_threads} x --episode_length {self.runner.episode_length}); "
                f"use --num_env_steps {per_iteration} or more"
            )
        if 0 < interval < per_iteration:
            raise ValueError(
                f"--agent_iteration_interval {interval} is counted in environment steps and one iteration collects "
                f"{per_iteration} (--n_rollout_threads x --episode_length): agents would switch more than once per "
                f"iteration. Use a multiple of {per_iteration}, e.g. {4 * per_iteration} to switch every 4 iterations"
            )

    @property
    def steps_per_iteration(self) -> int:
        """Environment steps collected per training iteration (computed): ``n_rollout_threads x episode_length``."""
        return self.runner.episode_length * self.runner.n_rollout_threads

    @property
    def num_iterations(self) -> int:
        """Training iterations (computed): one rollout batch and one update each."""
        return max(1, self.runner.num_env_steps // self.steps_per_iteration)

    def iterations_after(self, iteration: int, env_steps: int) -> int:
        """Training iterations in all (computed) of a run resumed after ``iteration`` iterations that collected
        ``env_steps`` env steps: those plus the env steps left of ``num_env_steps`` at this run's rollout size (the
        rollout size may have changed on resume; unchanged, this is :attr:`num_iterations`)."""
        return iteration + max(0, self.runner.num_env_steps - env_steps) // self.steps_per_iteration

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        return cls(
            model=ModelConfig(**data["model"]),
            env=EnvConfig(**data["env"]),
            algo=AlgoConfig(**data["algo"]),
            runner=RunnerConfig(**data["runner"]),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def to_yaml(self) -> str:
        """The resolved config as a YAML run config that ``--config`` reads back to start a run like this one:
        without ``load_path`` and ``output_dir`` (where this run started from and wrote to: ``config.json`` has them)."""
        import yaml

        values = self.to_dict()
        for name in ("load_path", "output_dir"):
            values["runner"].pop(name)
        header = "# the run's resolved config (marft train --config this.yaml); load_path and output_dir are in config.json\n"
        return header + yaml.safe_dump(values, sort_keys=False)


SECTIONS = {"model": ModelConfig, "env": EnvConfig, "algo": AlgoConfig, "runner": RunnerConfig}


CHOICES: dict[str, dict] = {"dtype": DTYPES, "algorithm_name": TRAINERS, "normalization_mode": NORMALIZATION_MODES, "rollout_correction": ROLLOUT_CORRECTIONS,
                            "critic_mode": CRITIC_MODES, "critic_init": CRITIC_INITS, "credit_assignment": CREDIT_MODES, "workflow": WORKFLOWS,
                            "game_view": GAME_VIEWS,
                            "chat_template": CHAT_TEMPLATE_MODES, "generation_backend": GENERATION_BACKENDS,
                            "kl_reference": KL_REFERENCES, "lr_schedule": LR_SCHEDULES, "on_collapse": ON_COLLAPSE,
                            "kl_estimator": KL_ESTIMATORS}
"""Flags with a fixed set of values → the one table that defines them (its keys are the allowed values)."""


def check_choice(flag: str, value) -> None:
    """Raise a ``ValueError`` naming the allowed values when ``value`` is not in ``CHOICES[flag]``."""
    if value not in CHOICES[flag]:
        raise ValueError(f"--{flag} must be one of {', '.join(CHOICES[flag])}, got {value!r}")


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


def parse_bool(text: str) -> bool:
    """A command-line boolean: 1/true/yes/on or 0/false/no/off (any case)."""
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

        def optional(text: str):
            return None if text.lower() == "none" else convert(text)

        optional.__name__ = f"{getattr(convert, '__name__', 'value')} or none"  # argparse names it in "invalid ... value"
        return optional
    if hint is bool:
        return parse_bool
    return hint


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr (``error: ...``, exit code 2), without the usage block."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser(description: str = "Train an LLM agent team with multi-agent PPO.", with_defaults: bool = True,
                 sections: dict | None = None, parser: argparse.ArgumentParser | None = None, defaults: dict | None = None,
                 exclude: tuple[str, ...] = (), flat: bool = False) -> argparse.ArgumentParser:
    """One flag per config field, grouped by section (default :data:`SECTIONS`), help text from the field
    docstrings, allowed values from :data:`CHOICES`. ``with_defaults=False`` leaves flags that are not given
    out of the namespace (how :func:`parse_config` tells which flags were given).

    For other commands built on the config (the benchmark): ``parser`` receives the flags (default: a new one),
    ``defaults`` replaces some fields' defaults, ``exclude`` leaves fields out, and ``flat`` names each value by
    its field alone (``args.lr``) rather than by section and field (``"algo.lr"``)."""
    parser = parser or OneLineErrorParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = defaults or {}
    for section, cls in (sections or SECTIONS).items():
        group = parser.add_argument_group(section, cls.__doc__)
        docs = field_docs(cls)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in exclude:
                continue
            default = defaults.get(f.name, f.default) if with_defaults else argparse.SUPPRESS
            kwargs = dict(dest=f.name if flat else f"{section}.{f.name}", type=_flag_type(hints[f.name]), default=default,
                          help=docs.get(f.name, "") + rule_text(f.name))
            if f.name in CHOICES:
                kwargs["choices"] = list(CHOICES[f.name])
            if hints[f.name] is bool:
                kwargs["nargs"] = "?"
                kwargs["const"] = True
            group.add_argument(f"--{f.name}", **kwargs)
    return parser


def parse_sections(argv: list[str], sections: dict, description: str) -> tuple[dict, set[str], argparse.ArgumentParser]:
    """``({section: {field: value}}, given field names, parser)`` for the flags of ``sections``.

    ``--config FILE.yaml`` (anywhere in ``argv``) fills fields first (:func:`read_yaml_config`); flags given on the
    command line override it. Fields set in the file count as given."""
    argv, yaml_path = _split_config_flag(argv)
    parser = build_parser(description, sections=sections)
    parser.add_argument("--config", metavar="FILE.yaml", help="a YAML run config: the config fields, flat or by section; flags override it")
    from_file = {}
    if yaml_path is not None:
        try:
            from_file = read_yaml_config(yaml_path, sections)
        except (OSError, ValueError) as error:
            parser.error(str(error))
        parser.set_defaults(**{f"{section}.{name}": value for section, fields in from_file.items() for name, value in fields.items()})
    values = {section: {} for section in sections}
    for key, value in vars(parser.parse_args(argv)).items():
        if key == "config":
            continue
        section, name = key.split(".", 1)
        values[section][name] = value
    given = {key.split(".", 1)[1] for key in vars(build_parser(description, with_defaults=False, sections=sections).parse_args(argv))}
    return values, given | {name for fields in from_file.values() for name in fields}, parser


def _split_config_flag(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` without ``--config FILE`` / ``--config=FILE``, and that file (None: not given).

    Raises:
        SystemExit: ``--config`` given twice (one ``error:`` line)."""
    rest, paths, i = [], [], 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            paths.append(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith("--config="):
            paths.append(argv[i].split("=", 1)[1])
        else:
            rest.append(argv[i])
        i += 1
    if len(paths) > 1:
        OneLineErrorParser().error(f"--config given {len(paths)} times ({', '.join(paths)}): give one run config")
    return rest, (paths[0] if paths else None)


def _yaml_loader():
    """PyYAML's safe loader reading every plain scalar but ``null``/``~`` as text, and refusing a key given twice in
    one mapping: the values then go through the flags' own converters, so ``seed: 010`` is 10 as ``--seed 010`` is,
    not YAML 1.1's octal 8 (nor ``1:30`` base 60, nor ``0x10``)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"{key!r} is set twice", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    StrictLoader.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag == "tag:yaml.org,2002:null"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    return StrictLoader


def read_yaml_config(path: str, sections: dict | None = None) -> dict[str, dict[str, Any]]:
    """A YAML run config as ``{section: {field: value}}``: the file maps field names to values, either flat
    (``lr: 0.001``) or under their sections (``algo: {lr: 0.001}``). Values are checked against the fields' types
    (strings are read as the flag would read them).

    Raises:
        ValueError: not a mapping, an unknown key (the message names the nearest valid one), a field set twice, or
            a value of the wrong type. FileNotFoundError: no such file.
    """
    import difflib

    import yaml

    sections = sections or SECTIONS
    try:
        with open(path, encoding="utf-8") as file:
            data = yaml.load(file, Loader=_yaml_loader())
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML ({' '.join(str(error).split())})") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text ({error.reason})") from None
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply to be a run config") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a run config is a mapping of config fields to values, got a {type(data).__name__}")
    owner = {f.name: section for section, cls in sections.items() for f in dataclasses.fields(cls)}
    hints = {section: get_type_hints(cls) for section, cls in sections.items()}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in sections and key not in owner:
            if value is not None and not isinstance(value, dict):
                raise ValueError(f"{path}: section {key!r} must hold its fields (name: value), got {value!r}")
            pairs = [(name, item, key) for name, item in (value or {}).items()]
        else:
            pairs = [(key, value, None)]
        for name, item, section in pairs:
            if name not in owner or (section is not None and owner[name] != section):
                valid = ((list(sections) if isinstance(item, dict) else []) if section is None else []) or \
                    [n for n, s in owner.items() if section is None or s == section] + ([] if section else list(sections))
                near = difflib.get_close_matches(str(name), valid, n=1)
                where = f" in section {section!r}" if section else ""
                raise ValueError(f"{path}: unknown key {name!r}{where}" + (f"; did you mean {near[0]!r}?" if near else ""))
            if name in flat:
                raise ValueError(f"{path}: {name!r} is set twice")
            flat[name] = _yaml_value(path, name, hints[owner[name]][name], item)
    out: dict[str, dict[str, Any]] = {}
    for name, value in flat.items():
        out.setdefault(owner[name], {})[name] = value
    return out


def _yaml_value(path: str, name: str, hint: Any, value: Any) -> Any:
    """``value`` from YAML for a field of type ``hint``: text converted as its flag would be (every plain scalar is
    text, :func:`_yaml_loader`), ``null`` for an optional field, anything else (a list, a mapping) refused."""
    if isinstance(value, str):
        try:
            return _flag_type(hint)(value)
        except (TypeError, ValueError, OverflowError, argparse.ArgumentTypeError) as error:
            raise ValueError(f"{path}: {name}: {error}") from None
    args = getattr(hint, "__args__", None)
    if value is None and args and type(None) in args:
        return None
    inner = next((a for a in args if a is not type(None)), hint) if args else hint
    ok = (isinstance(value, bool) if inner is bool else
          isinstance(value, int) and not isinstance(value, bool) if inner is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if inner is float else isinstance(value, inner))
    if not ok:
        raise ValueError(f"{path}: {name} must be {getattr(inner, '__name__', inner)}, got {value!r}")
    return float(value) if inner is float else value


def parse_config(argv: Optional[list[str]] = None) -> tuple[TrainConfig, set[str]]:
    """Parse flags into a :class:`TrainConfig`; also return the field names given explicitly.

    The given flags are what argparse itself parsed (a second pass without defaults), so abbreviated
    flags (``--num_env 8192``) and ``--flag=value`` count as given, exactly as argparse read them.
    """
    argv = sys.argv[1:] if argv is None else argv
    values, given, parser = parse_sections(argv, SECTIONS, "Train an LLM agent team with multi-agent PPO.")
    try:
        config = TrainConfig.from_dict(values)
    except ValueError as error:
        parser.error(str(error))
    return config, given
