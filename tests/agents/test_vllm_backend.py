"""``--generation_backend vllm``: the parts that need no vLLM (head padding, LoRA ranks, the rollout correction, the
mismatch figures, the buffer's engine log-probs, the install error), and the engine's own checks
(``tests/vllm_engine_checks.py``), which run in the environment that has vLLM (``scripts/setup_vllm.sh``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from marft.agents.vllm_backend import HeadPadding, engine_lora_rank, head_padding, write_served_model
from marft.algorithms.losses import clipped_policy_loss, rollout_correction_weights
from marft.runner.shared.buffer import RolloutBuffer
from marft.types import EngineGap, TurnOutput

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


# ---------------------------------------------------------------- head padding (exact, checked in transformers)
def _load(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _as_qwen2(folder: Path) -> Path:
    """The served (Llama-architecture) copy read back as the Qwen2 it is (transformers' Llama would drop the q/k/v
    biases that vLLM's Llama keeps with ``qkv_bias``)."""
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_padded_heads_give_the_same_logits(random_model_dir, tmp_path):
    original = _load(random_model_dir)
    padding = head_padding(original.config, [32, 64])
    assert padding == HeadPadding(head_dim=original.config.hidden_size // original.config.num_attention_heads, served_dim=32)
    padded = _load(_as_qwen2(write_served_model(random_model_dir, original.config, padding, tmp_path / "served")))
    assert padded.config.head_dim == 32
    ids = torch.randint(3, original.config.vocab_size, (3, 40))
    with torch.no_grad():
        assert torch.allclose(padded(input_ids=ids).logits, original(input_ids=ids).logits, atol=1e-4)


def test_padded_adapters_give_the_same_logits(random_model_dir, tmp_path):
    """A LoRA adapter on every linear layer, padded as the engine gets it, changes the padded model as the original."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    original = _load(random_model_dir)
    padding = head_padding(original.config, [32])
    padded = _load(_as_qwen2(write_served_model(random_model_dir, original.config, padding, tmp_path / "served")))
    def lora():
        return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")

    original, padded = get_peft_model(original, lora()), get_peft_model(padded, lora())
    with torch.no_grad():
        for name, p in original.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    heads = (original.config.num_attention_heads, original.config.num_key_value_heads)
    state = {name: padding.pad(name, t, *heads) for name, t in get_peft_model_state_dict(original).items()}
    set_peft_model_state_dict(padded, state)
    ids = torch.randint(3, original.config.vocab_size, (2, 30))
    with torch.no_grad():
        changed = original(input_ids=ids).logits
        assert torch.allclose(padded(input_ids=ids).logits, changed, atol=1e-4)
        with original.disable_adapter():
            assert not torch.allclose(original(input_ids=ids).logits, changed, atol=1e-3)  # the adapters matter


def test_supported_heads_are_served_as_they_are_and_others_are_refused(random_model_dir):
    config = _load(random_model_dir).config
    head_dim = config.hidden_size // config.num_attention_heads
    assert head_padding(config, [head_dim, 64]) is None
    assert head_padding(config, []) is None  # a GPU: every size
    with pytest.raises(ValueError, match="decode_loop"):
        head_padding(config, [8])  # nothing larger to pad to
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="default rotary"):
        head_padding(config, [32])


def test_lora_ranks_round_up_to_what_vllm_serves():
    assert [engine_lora_rank(r) for r in (1, 2, 8, 9, 16, 17, 300, 512)] == [1, 8, 8, 16, 16, 32, 320, 512]
    with pytest.raises(ValueError, match="decode_loop"):
        engine_lora_rank(513)


# ---------------------------------------------------------------- rollout correction
def test_correction_weights_against_a_plain_reference():
    old = torch.tensor([0.0, -1.0, -2.0, -0.5, -3.0])
    engine = torch.tensor([0.0, -2.0, -1.0, -0.5, -0.2])
    ratio = [float(torch.exp(o - e)) for o, e in zip(old, engine)]
    truncated = rollout_correction_weights(old, engine, "truncate", 2.0)
    assert truncated.tolist() == pytest.approx([min(r, 2.0) for r in ratio])
    masked = rollout_correction_weights(old, engine, "mask", 2.0)
    assert masked.tolist() == [1.0 if 0.5 <= r <= 2.0 else 0.0 for r in ratio]
    assert rollout_correction_weights(old, engine, "none", 2.0) is None
    assert rollout_correction_weights(old, None, "truncate", 2.0) is None  # the trainer's own sampling: no weights


def test_the_correction_scales_each_surrogate_and_carries_no_gradient():
    new = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    old, adv = torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([1.0, -1.0, 2.0])
    weights = torch.tensor([0.5, 1.0, 0.0])
    loss, _ = clipped_policy_loss(new, old, adv, 0.2, correction=weights)
    assert float(loss.detach()) == pytest.approx(-(0.5 * 1.0 + 1.0 * -1.0 + 0.0) / 3)
    loss.backward()
    assert new.grad.tolist() == pytest.approx([-0.5 / 3, 1.0 / 3, 0.0])


def test_engine_gap_figures():
    gap = EngineGap()
    trainer = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    engine = torch.tensor([[-1.1, -1.8, -9.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    gap.add(trainer, engine, mask)
    figures = gap.take()
    assert figures["rollout/engine_logprob_gap_mean"] == pytest.approx((0.1 + 0.2 + 0.0) / 3)
    assert figures["rollout/engine_logprob_gap_max"] == pytest.approx(0.2)
    assert figures["rollout/engine_token_ratio_max"] == pytest.approx(float(torch.exp(torch.tensor(0.1))))
    assert figures["rollout/engine_reply_ratio_max"] == pytest.approx(1.0)  # row 0: 0.1 − 0.2; row 1: 0
    assert gap.take() == {}  # starts over


def _turn(B, L, engine=None):
    return TurnOutput(torch.ones(B, 3, dtype=torch.long), torch.ones(B, 3, dtype=torch.long), torch.ones(B, L, dtype=torch.long),
                      torch.ones(B, L, dtype=torch.long), torch.full((B, L), -1.0), ["x"] * B, sampling_logprobs=engine)


def test_the_buffer_keeps_engine_logprobs_only_when_an_engine_sampled():
    plain = RolloutBuffer(1, 2, 2, 3, 4, 0)
    plain.insert_turn(0, 0, _turn(2, 4))
    assert plain.agent_samples(0).sampling_logprobs is None
    engine = RolloutBuffer(1, 2, 2, 3, 4, 0)
    engine.insert_turn(0, 0, _turn(2, 4, engine=torch.full((2, 4), -1.5)))
    engine.insert_turn(0, 1, _turn(2, 4))
    assert engine.agent_samples(0).sampling_logprobs.eq(-1.5).all()
    assert engine.agent_samples(1).sampling_logprobs.eq(-1.0).all()  # no engine for that turn: its own log-probs


@pytest.mark.parametrize("algorithm", ["APPO", "TPPO", "GRPO"])
def test_the_policy_loss_weights_engine_replies_by_the_correction(random_model_dir, algorithm):
    """Replies whose engine probability is a third of the trainer's (ratio 3 per token, above the cap 2): ``truncate``
    doubles each surrogate (the policy is still the rollout's, so every PPO ratio is 1), ``mask`` drops them all,
    no mismatch leaves the loss as it is; without engine log-probs nothing changes at all."""
    from test_team import fill_buffer, make_team

    from marft.algorithms import trainer_class
    from marft.config import AlgoConfig

    torch.manual_seed(0)
    team = make_team(random_model_dir)
    losses = {}
    for mode in ("truncate", "mask"):
        trainer = trainer_class(algorithm)(team, AlgoConfig(algorithm_name=algorithm, group_size=4, rollout_correction=mode, rollout_correction_cap=2.0, kl_coef=0.0),
                                           steps_per_iteration=4)
        if mode == "truncate":
            torch.manual_seed(1)
            samples = fill_buffer(team, trainer=trainer).agent_samples(0, token_level=trainer.token_level).trimmed(team.device)
            samples = samples.replace(advantages=samples.advantages.abs() + 0.1) if samples.advantages is not None else samples
        mask = samples.response_mask.float()
        adapter = team.agent_adapters[0]
        with torch.no_grad():
            plain = float(trainer.policy_loss(adapter, samples)[0])
            same = float(trainer.policy_loss(adapter, samples.replace(sampling_logprobs=samples.logprobs.clone()))[0])
            third = samples.replace(sampling_logprobs=(samples.logprobs - torch.log(torch.tensor(3.0))) * mask)
            losses[mode] = float(trainer.policy_loss(adapter, third)[0])
        assert same == pytest.approx(plain, rel=1e-5)
        assert trainer.counters["rollout_corrected"] > 0
    assert plain != 0
    assert losses["truncate"] == pytest.approx(2 * plain, rel=1e-5)
    assert losses["mask"] == 0


# ---------------------------------------------------------------- install error, and the engine's checks
def test_training_without_vllm_installed_says_how_to_install_it(tmp_path):
    """``import vllm`` fails (not installed, or broken): one error line before anything loads, naming the fallback."""
    script = ("import sys\nsys.modules['vllm'] = None  # import vllm raises ImportError\n"
              "from marft.cli.train import main\nsys.exit(main(['--generation_backend', 'vllm', '--output_dir', sys.argv[1]]))\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: ") and "setup_vllm.sh" in error[0] and "decode_loop" in error[0]
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_the_engine_checks_pass_where_vllm_is_installed():
    """``tests/vllm_engine_checks.py`` (log-probs, greedy replies, adapter sync, 200 syncs, a training run) in the
    environment with vLLM: this one when it has vLLM, else ``.venv-vllm`` (``scripts/setup_vllm.sh``; CI builds it)."""
    import importlib.util

    python = sys.executable if importlib.util.find_spec("vllm") else str(VLLM_PYTHON)
    if not Path(python).exists():
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run the vLLM checks: scripts/setup_vllm.sh builds .venv-vllm")
        pytest.skip("vLLM is not installed here: bash scripts/setup_vllm.sh builds .venv-vllm with the CPU build")
    result = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/vllm_engine_checks.py"],
                            capture_output=True, text=True, cwd=ROOT, timeout=1800)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
