"""Reply tokens scored a few rows at a time (``--max_logits_mib``, :mod:`marft.agents.reply_scores`): the
one-pass log-probs, entropies, top-k counts and gradients, while the backward keeps only each chunk's hidden
states instead of the vocabulary's logits."""

import pytest
import torch
from test_shared_header_update import assert_same_gradients, gradients, rollout

from marft.agents import reply_scores
from marft.agents.reply_scores import chunked_token_scores, rows_per_chunk, score_tokens

pytestmark = pytest.mark.usefixtures("one_thread")

B, L, H, V = 7, 8, 16, 50_000
"""Seven rows of 8 reply tokens over a 50,000-token vocabulary: 1.8 MB of float32 logits per row (L + 1 positions)."""


def _batch(seed=0):
    torch.manual_seed(seed)
    output_layer = torch.nn.Linear(H, V, bias=False)
    states = torch.randn(B, L + 1, H, requires_grad=True)
    response_ids = torch.randint(0, V, (B, L))
    response_mask = torch.ones(B, L)
    response_mask[2, 5:] = 0  # replies ended early
    response_mask[6, 1:] = 0
    return output_layer, states, response_ids, response_mask


def _tempered(logits):
    return logits.float() / 0.7


def test_rows_per_chunk_fits_the_budget():
    assert rows_per_chunk(7, 8, 50_000, 0) == 7  # no budget: one pass
    assert rows_per_chunk(7, 8, 50_000, 4) == 2  # 4 MiB / 1.6 MB per row
    assert rows_per_chunk(7, 9, 50_000, 4) == 2  # the L + 1 positions whose logits are formed
    assert rows_per_chunk(7, 8, 50_000, 1) == 1  # a row over the budget is its own chunk
    assert rows_per_chunk(7, 8, 50_000, 1024) == 7
    assert rows_per_chunk(128, 128, 151_936, 1024) == 13  # Qwen2.5's vocabulary, 128-token replies


@pytest.mark.parametrize("entropy_grad", [True, False], ids=["entropy_in_the_loss", "entropy_logged"])
def test_chunks_give_the_one_pass_scores_and_gradients(entropy_grad):
    """Log-probs, entropies, the top-k count and the gradient of the states (through log-probs and, when in the
    loss, entropies) equal those of one pass over all rows, with 4 chunks of at most 2 rows."""
    output_layer, states, response_ids, response_mask = _batch()
    weights = torch.randn(B, L)
    results = []
    for budget in (0, 4):
        states.grad = None
        scores = chunked_token_scores(states, output_layer, _tempered, response_ids, response_mask, with_entropy=True,
                                      entropy_grad=entropy_grad, top_k=5, max_logits_mib=budget)
        loss = (scores.logprobs * weights).sum() + (scores.entropy * weights.flip(0)).sum() * entropy_grad
        loss.backward()
        results.append((scores, states.grad.clone()))
    (one, one_grad), (chunked, chunked_grad) = results
    assert one.out_of_topk == chunked.out_of_topk > 0
    assert chunked.entropy.requires_grad == entropy_grad
    torch.testing.assert_close(chunked.logprobs, one.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked.entropy, one.entropy, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked_grad, one_grad, atol=1e-6, rtol=0)
    assert (chunked.logprobs[response_mask == 0] == 0).all() and (chunked.entropy[response_mask == 0] == 0).all()


def test_within_the_budget_the_scores_are_the_one_pass_scores_bit_for_bit():
    """A batch that fits the budget (every small-vocabulary run) computes exactly what it did before chunking existed."""
    output_layer, states, response_ids, response_mask = _batch(1)
    with torch.no_grad():
        ours = chunked_token_scores(states, output_layer, _tempered, response_ids, response_mask, with_entropy=True, max_logits_mib=1024)
        plain = score_tokens(_tempered(output_layer(states)[:, :-1]), response_ids, response_mask, True, True, 0)
    assert torch.equal(ours.logprobs, plain.logprobs) and torch.equal(ours.entropy, plain.entropy)


def _saved_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for the backward while ``fn`` runs (outside checkpointed regions)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(saved)


def test_the_backward_keeps_the_chunks_states_not_their_logits():
    """Without a budget the graph keeps several (B, L, V) float32 tensors; with 2-row chunks it keeps none of them
    (each chunk's logits are recomputed in the backward), and the backward still runs. (The tensors a checkpointed
    chunk holds while it runs are transient and not seen here; the memory suite measures the process's peak.)"""
    output_layer, states, response_ids, response_mask = _batch(2)
    logits_bytes = B * L * V * 4

    def run(budget):
        return lambda: chunked_token_scores(states, output_layer, _tempered, response_ids, response_mask, with_entropy=True,
                                            max_logits_mib=budget).logprobs.sum().backward()

    assert _saved_bytes(run(0)) > logits_bytes
    assert _saved_bytes(run(4)) < logits_bytes / B  # less than one row's logits


@pytest.mark.parametrize("model", [{}, {"gradient_checkpointing": True}], ids=["unpadded_forward", "gradient_checkpointing"])
def test_update_gradients_with_scored_chunks_equal_one_pass(random_model_dir, monkeypatch, model):
    """Every policy and critic gradient of a first update step of three agents (entropy and KL in the loss) is the
    same with the replies scored one row at a time as in one pass, and the chunked path really ran: on the real
    tokens (the default), and on transformers' padded forward with its layers checkpointed."""
    team, trainer, buffer = rollout(random_model_dir, "APPO", algo={"entropy_coef": 0.01, "kl_coef": 0.1}, **model)
    assert team.logits_from_states  # a Qwen2-style model: its logits are formed from the decoder's states
    plain, _ = gradients(team, trainer, buffer, shared=True, monkeypatch=monkeypatch)
    chunks = []
    with monkeypatch.context() as patch:
        patch.setattr(reply_scores, "rows_per_chunk", lambda rows, *args: chunks.append(rows) or 1)
        chunked, _ = gradients(team, trainer, buffer, shared=True, monkeypatch=monkeypatch)
    assert chunks and max(chunks) > 1  # batches of several rows were cut into single rows
    assert_same_gradients(chunked, plain)


def test_other_models_form_their_logits_in_one_forward():
    """Models whose head may do more than its output layer are not scored from states: another family, and a class
    outside transformers that only names a Llama-family model type (remote code with its own head)."""
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    from marft.agents.unpadded import logits_from_last_states

    class ScaledHead(Qwen2ForCausalLM):  # e.g. remote code that scales the logits
        pass

    qwen2 = Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    assert logits_from_last_states(Qwen2ForCausalLM(qwen2))
    assert not logits_from_last_states(ScaledHead(qwen2))
    assert not logits_from_last_states(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)))
