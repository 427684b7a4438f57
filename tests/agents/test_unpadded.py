"""The forward on real tokens only (``--unpadded_forward``, :mod:`marft.agents.unpadded`): the same hidden
states, log-probs, values and gradients as transformers' padded forward, for each supported architecture."""

import dataclasses

import pytest
import torch
from test_shared_header_update import assert_same_gradients, gradients, rollout
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from marft.agents.headers import position_ids_from_mask
from marft.agents.unpadded import supports_unpadded, unpadded_decoder_states

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
CONFIGS = {
    "qwen2": Qwen2Config(**SMALL),
    "llama": LlamaConfig(**SMALL),
    "qwen3": Qwen3Config(**SMALL, head_dim=16),  # q/k norms
}


@pytest.mark.parametrize("tail", [None, 4], ids=["all_tokens", "last_4_columns"])
@pytest.mark.parametrize("with_cache", [False, True], ids=["no_cache", "cached_prefix"])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_hidden_states_and_gradients_equal_the_padded_forward(arch, with_cache, tail):
    """Rows with left padding, pads between a cached prefix and the rest, and right-padded ends: the real tokens'
    hidden states (all of them, or those of the last 4 columns, where the last layer skips the rest) and every
    parameter's gradient equal transformers' forward (float32 rounding)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch], attn_implementation="sdpa").float()
    assert supports_unpadded(model)
    decoder = model.get_decoder()
    B, C, S = 3, 5 if with_cache else 0, 12
    ids = torch.randint(0, 97, (B, S))
    mask = torch.ones(B, C + S, dtype=torch.long)
    mask[0, C : C + 4] = 0  # pads right after the prefix (or at the left)
    mask[1, -3:] = 0  # a right-padded end
    mask[2, :2] = 0  # a shorter cached prefix (left-padded), as role headers of different lengths
    positions = position_ids_from_mask(mask)[:, C:]
    prefix_ids = torch.randint(0, 97, (B, C))

    def run(unpadded: bool):
        model.zero_grad()
        cache = None
        if with_cache:
            cache = decoder(input_ids=prefix_ids, attention_mask=mask[:, :C], position_ids=position_ids_from_mask(mask[:, :C]), use_cache=True).past_key_values
        real = mask[:, C:].bool()
        if unpadded:
            hidden, _ = unpadded_decoder_states(decoder, cache, ids, mask, positions, tail=tail)
            if tail is not None:
                hidden = hidden[real[:, -tail:]]
        else:
            out = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=cache is not None).last_hidden_state
            hidden = out[real] if tail is None else out[:, -tail:][real[:, -tail:]]
        weights = torch.linspace(-1, 1, hidden.numel()).view_as(hidden)
        (hidden * weights).sum().backward()
        return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ours, our_grads = run(True)
    theirs, their_grads = run(False)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)
    assert our_grads.keys() == their_grads.keys() and len(our_grads) > 10
    for name in their_grads:
        scale = float(their_grads[name].abs().max())
        torch.testing.assert_close(our_grads[name], their_grads[name], atol=1e-4 * scale + 1e-7, rtol=0, msg=name)


def test_unsupported_models_use_the_padded_forward():
    """A sliding-window Mistral and a model type outside the Llama family are not run unpadded."""
    from transformers import GPT2Config, MistralConfig

    assert not supports_unpadded(AutoModelForCausalLM.from_config(MistralConfig(**SMALL, sliding_window=8)))
    assert not supports_unpadded(AutoModelForCausalLM.from_config(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)))


def end_early(team, buffer):
    """Env 0's replies end after 3 tokens (a random model never samples EOS): right-padded replies."""
    buffer.response_mask[:, 0, :, 3:] = 0
    buffer.response_ids[:, 0, :, 3:] = team.pad_id


def _unpadded(team, enabled: bool):
    team.headers.unpadded_forward = enabled


@pytest.mark.parametrize(
    "algorithm,model,algo",
    [
        ("APPO", {}, {"entropy_coef": 0.01, "kl_coef": 0.1}),
        ("TPPO", {"critic_mode": "per_agent"}, {"gradient_cp_steps": 2}),
        ("GRPO", {"shared_lora": True}, {"normalization_mode": "token"}),
    ],
    ids=["appo_entropy_kl", "tppo_per_agent_critics", "grpo_shared_lora"],
)
def test_update_gradients_equal_the_padded_forward(random_model_dir, monkeypatch, algorithm, model, algo):
    """Every policy and critic gradient of a first update step on a real rollout (three agents, private observations,
    histories cut from the left, replies ended early) is the padded forward's, with and without shared role headers."""
    team, trainer, buffer = rollout(random_model_dir, algorithm, context_window=120, algo=algo, **model)
    end_early(team, buffer)
    assert team.headers.unpadded_forward  # the default on a Qwen2-style model
    assert (buffer.prompt_mask == 0).any() and (buffer.response_mask == 0).any()  # there are pads to skip
    for shared in (True, False):
        ours, _ = gradients(team, trainer, buffer, shared=shared, monkeypatch=monkeypatch)
        _unpadded(team, False)
        theirs, _ = gradients(team, trainer, buffer, shared=shared, monkeypatch=monkeypatch)
        _unpadded(team, True)
        assert_same_gradients(ours, theirs)


def test_scores_and_values_equal_the_padded_forward(random_model_dir):
    """Log-probs, entropies and prompt/token values of a rollout's turns: unpadded == padded, and the pad share the
    update reports drops to the role headers' own padding."""
    team, trainer, buffer = rollout(random_model_dir, "TPPO", context_window=120)
    end_early(team, buffer)
    samples = buffer.critic_samples(token_level=True)
    args = (samples.prompt_ids, samples.prompt_mask, samples.response_ids, samples.response_mask)
    results = []
    for enabled in (True, False):
        _unpadded(team, enabled)
        with torch.no_grad():
            scores = team.response_logprobs(team.policy_adapters[0], *args, with_entropy=True, agents=samples.agent)
            values = team.critic.values(args[0], args[1], agent=samples.agent)
            token_values = team.critic.token_values(*args, agent=samples.agent)
        results.append((scores, values, token_values))
    (ours, our_values, our_tokens), (theirs, their_values, their_tokens) = results
    torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.entropy, theirs.entropy, atol=1e-5, rtol=0)
    torch.testing.assert_close(our_values, their_values, atol=1e-5, rtol=0)
    torch.testing.assert_close(our_tokens, their_tokens, atol=1e-5, rtol=0)
    assert ours.positions < theirs.positions and ours.padding < theirs.padding


def test_decode_loop_on_the_static_cache_samples_what_the_padded_steps_sample(random_model_dir):
    """The sampling loop with the prompt run unpadded and the steps on a preallocated cache samples the ids of the
    transformers-forward steps for a seed, with the same log-probs, with each adapter folded into the weights
    (the default) and unfolded, for agents behind a shared role header, private observations and padded prompts."""
    from test_team import HISTORIES

    team, _, _ = rollout(random_model_dir, "APPO")
    for fold in (True, False):
        team.config.merge_lora_in_rollout = fold
        for agent in range(team.n_agents):
            ids, mask = team.encode_prompts(agent, HISTORIES * 2, [[]] * 6, ["x = 7"] * 6 if agent == 0 else None)
            assert (mask == 0).any()
            replies = []
            for enabled in (True, False):
                _unpadded(team, enabled)
                torch.manual_seed(5)
                replies.append(team.sample(team.agent_adapters[agent], ids, mask, agent))
            _unpadded(team, True)
            ours, theirs = replies
            assert torch.equal(ours.response_ids, theirs.response_ids)
            torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_few_rows_linear_equals_the_linear_layer_and_steps_aside_where_it_does_not_apply(bias):
    """The weight-major product of a decode step (:func:`few_rows_linear`) gives the layer's output to float32
    rounding for a few rows; under autograd, for many rows and for a layer that is not a plain ``nn.Linear`` (a LoRA
    layer) it is the layer's own call, bit for bit."""
    from marft.agents.unpadded import FEW_ROWS, few_rows_linear

    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias)
    few, many = torch.randn(6, 48), torch.randn(FEW_ROWS + 1, 48)
    with torch.no_grad():
        ours = few_rows_linear(layer, few)
        assert ours.shape == (6, 80) and ours.is_contiguous()
        torch.testing.assert_close(ours, layer(few), atol=1e-5, rtol=1e-5)
        assert torch.equal(few_rows_linear(layer, many), layer(many))
        wrapped = torch.nn.Sequential(layer)  # any other module: called as it is
        assert torch.equal(few_rows_linear(wrapped, few), layer(few))
    traced = few_rows_linear(layer, few)
    assert traced.requires_grad and torch.equal(traced, layer(few))


def test_checking_for_the_end_every_few_steps_samples_the_same_replies(random_model_dir):
    """Asking whether every row has ended only every k steps (what a GPU does, to spare a synchronisation per token)
    gives the same replies and log-probs as asking every step: the extra steps give ended rows pads, masked out."""
    from test_team import HISTORIES

    from marft.agents.generation import DecodeLoop

    team, _, _ = rollout(random_model_dir, "APPO")
    assert isinstance(team.backend, DecodeLoop) and team.backend._stop_check_every(torch.device("cpu")) == 1
    settings = team.backend.settings
    bonus = torch.zeros(team.model.config.vocab_size)
    bonus[settings.eos_id] = 6.0  # the random model's replies end within a few tokens, so every row ends early

    @dataclasses.dataclass(frozen=True)
    class EndingSoon(type(settings)):
        def scoring_logits(self, logits):
            return super().scoring_logits(logits) + bonus[: logits.shape[-1]]

    ids, mask = team.encode_prompts(0, HISTORIES * 2, [[]] * 6, ["x = 7"] * 6)
    replies, drawn_after = [], []
    try:
        fields = {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)}
        team.backend.settings = EndingSoon(**{**fields, "max_new_tokens": 24})
        for every in (1, 5):
            team.backend.stop_check_every = every
            torch.manual_seed(3)
            replies.append(team.sample(team.agent_adapters[0], ids, mask, 0))
            drawn_after.append(torch.rand(1))  # the extra steps draw random numbers: the stream moves on
    finally:
        team.backend.stop_check_every, team.backend.settings = None, settings
    (each, fifth) = replies
    ended = each.response_mask.sum(1)
    assert ended.max() < 24 - 5 and ended.max() % 5 != 0, f"the rows must all end early, between two checks: {ended}"
    assert not torch.equal(*drawn_after)  # the every-5 loop ran on past the last end
    assert torch.equal(each.response_ids * each.response_mask, fifth.response_ids * fifth.response_mask)
    assert torch.equal(each.response_mask, fifth.response_mask)
    assert torch.equal(each.logprobs, fifth.logprobs)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_decode_steps_of_rows_of_several_adapters_equal_each_adapters_own_steps(arch):
    """:class:`RowAdapters`: the rows of one static-cache decode step, each through its own LoRA adapter, give what each
    adapter's rows give stepped on their own (float32 rounding): adapters of different ranks, one of them on fewer
    layers (a layer without a row's adapter adds nothing to it)."""
    from peft import LoraConfig, get_peft_model

    from marft.agents.unpadded import RowAdapters, StaticKVDecoder, linear

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(CONFIGS[arch], attn_implementation="sdpa").float()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"])
    model = get_peft_model(base, lora, adapter_name="one")
    model.add_adapter("two", LoraConfig(r=2, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "lm_head"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)  # both adapters away from zero, and apart
    model.eval()
    decoder, head = model.get_base_model().get_decoder(), model.get_base_model().get_output_embeddings()
    B, S = 4, 10
    ids = torch.randint(0, 97, (B, S))
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :3] = 0
    mask[3, :6] = 0
    positions = position_ids_from_mask(mask)
    rows = RowAdapters(["one", "two"], torch.tensor([1, 0, 1, 0]))
    with torch.no_grad():
        model.set_adapter("one")  # the prompts' keys and values (any adapter: the steps are what is compared)
        _, _, kept = unpadded_decoder_states(decoder, None, ids, mask, positions, tail=1, keep_keys_values=True)
        mixed = StaticKVDecoder(decoder, kept, mask, 2, rows)
        stepped = [linear(head, mixed.step(ids[:, t], positions[:, -1] + 1 + t), rows) for t in range(2)]  # (B, V) per step
        for name, picked in rows.rows.items():
            model.set_adapter(name)
            alone = StaticKVDecoder(decoder, [(k[picked], v[picked]) for k, v in kept], mask[picked], 2)
            for t in range(2):
                expected = head(alone.step(ids[picked, t], positions[picked, -1] + 1 + t))
                torch.testing.assert_close(stepped[t][picked], expected, atol=1e-5, rtol=0)
        model.set_adapter("one")  # the rows of "two" through "one": another result, so the check above is not vacuous
        other = StaticKVDecoder(decoder, kept, mask, 2)
        assert not torch.allclose(head(other.step(ids[:, 0], positions[:, -1] + 1))[rows.rows["two"]], stepped[0][rows.rows["two"]], atol=1e-3)


def test_rows_of_several_adapters_on_a_half_precision_model():
    """peft keeps LoRA weights in float32 over a bfloat16 base: a row's LoRA product runs in the adapters' dtype and is
    added in the base's, as peft's forward does it."""
    from peft import LoraConfig, get_peft_model

    from marft.agents.unpadded import RowAdapters, linear

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(CONFIGS["qwen2"], attn_implementation="sdpa").to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]), adapter_name="one", autocast_adapter_dtype=True)
    model.add_adapter("two", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    layer = model.get_base_model().get_decoder().layers[0].self_attn.q_proj
    with torch.no_grad():
        for name in ("one", "two"):
            layer.lora_B[name].weight.normal_(0.0, 0.3)
    model.eval()
    assert layer.lora_A["one"].weight.dtype == torch.float32 and layer.base_layer.weight.dtype == torch.bfloat16
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    rows = RowAdapters(["one", "two"], torch.tensor([1, 0, 1]))
    with torch.no_grad():
        mixed = linear(layer, x, rows)
        assert mixed.dtype == torch.bfloat16
        for name, picked in rows.rows.items():
            model.set_adapter(name)
            torch.testing.assert_close(mixed[picked], layer(x[picked]), atol=2e-2, rtol=2e-2)
