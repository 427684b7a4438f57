"""``--max_chunk_tokens`` (issue 30, memory): a minibatch's gradient-accumulation chunks are cut by a budget of the
positions their forward runs, so a chunk of later agents' longer prompts holds no more than the budget; the gradient is
the same."""

import pytest
import torch
from test_rl_audit import one_step_gradients, perturb_adapters
from test_team import fill_buffer, make_team

from marft.algorithms import TRAINERS, trainer_class
from marft.algorithms.appo_trainer import APPOTrainer
from marft.algorithms.batching import token_budget_split
from marft.config import AlgoConfig
from marft.types import TurnBatch

pytestmark = pytest.mark.usefixtures("one_thread")


def padded_tokens(samples: TurnBatch, chunk: torch.Tensor) -> int:
    """Tokens of ``chunk``'s forward as the trainer runs it: rows x (trimmed prompt + trimmed reply columns)."""
    mb = TurnBatch(prompt_ids=samples.prompt_ids, prompt_mask=samples.prompt_mask, response_ids=samples.response_ids,
                   response_mask=samples.response_mask).rows(chunk).trimmed("cpu")
    width = mb.prompt_ids.shape[1] + (mb.response_ids.shape[1] if mb.response_ids is not None else 0)
    return len(chunk) * width


class ForwardPositions:
    """Spies on a team's forwards with gradients: per rows' forward (one per chunk), the positions it ran (rows x
    columns after the shared headers) plus those of the header forward before it (headers x longest header)."""

    def __init__(self, team, monkeypatch):
        self.chunks, self.headers = [], 0
        headers = team.headers
        forward_headers, decoder_states = headers.forward_headers, headers.decoder_states

        def spy_headers(header_ids, header_mask):
            if torch.is_grad_enabled():
                self.headers += header_ids.numel()
            return forward_headers(header_ids, header_mask)

        def spy_states(cache, ids, mask, tail):
            if torch.is_grad_enabled():
                cached = 0 if cache is None else cache.get_seq_length()
                self.chunks.append(ids[:, cached:].numel() + self.headers)
                self.headers = 0
            return decoder_states(cache, ids, mask, tail)

        monkeypatch.setattr(headers, "forward_headers", spy_headers)
        monkeypatch.setattr(headers, "decoder_states", spy_states)


def test_split_keeps_order_and_fits_the_budget():
    """Rows in order, padded width = longest prompt + longest reply; a row wider than the budget is a part alone."""
    prompt = torch.tensor([2, 3, 3, 4, 9, 5])  # real prompt tokens per row
    reply = torch.tensor([1, 1, 2, 2, 3, 1])
    P, L = 10, 4
    prompt_mask = (torch.arange(P).flip(0) < prompt[:, None]).long()  # left padding
    response_mask = (torch.arange(L) < reply[:, None]).long()  # right padding
    samples = TurnBatch(prompt_ids=prompt_mask * 7, prompt_mask=prompt_mask, response_ids=response_mask * 7, response_mask=response_mask)
    chunk = torch.tensor([5, 0, 1, 2, 3, 4])
    parts = token_budget_split(samples, chunk, budget=12)
    # row 5 (6) + row 0 -> 2 x 6 = 12 fits; + row 1 -> 3 x 6 = 18 no; rows 1,2 -> 2 x 5 = 10; + row 3 -> 3 x 6 no;
    # row 3 (6) alone (+ row 4 -> 2 x 12 no); row 4 (12) alone
    assert [p.tolist() for p in parts] == [[5, 0], [1, 2], [3], [4]]
    assert torch.equal(torch.cat(parts), chunk)
    assert all(padded_tokens(samples, p) <= 12 for p in parts)
    assert [p.tolist() for p in token_budget_split(samples, chunk, budget=1)] == [[r] for r in chunk.tolist()]
    assert [p.tolist() for p in token_budget_split(samples, chunk, budget=10**6)] == [chunk.tolist()]


def test_split_counts_the_longest_header_before_the_longest_rest():
    """Rows of agents whose role headers differ run behind shared headers as [longest header][longest rest]: two rows
    of 8 prompt tokens, one behind a 6-token header (rest 2), one behind a 2-token header (rest 6), run 2 x 6 positions
    behind two header rows of 6 (the critic's chunks mix agents), not 2 x 8."""
    P = 10
    prompt_mask = (torch.arange(P).flip(0) < torch.tensor([8, 8])[:, None]).long()
    samples = TurnBatch(agent=torch.tensor([0, 1]), prompt_ids=prompt_mask * 7, prompt_mask=prompt_mask)
    chunk, headers = torch.tensor([0, 1]), torch.tensor([6, 2])
    assert [p.tolist() for p in token_budget_split(samples, chunk, budget=20)] == [[0, 1]]
    assert [p.tolist() for p in token_budget_split(samples, chunk, budget=20, header_lengths=headers)] == [[0], [1]]
    assert [p.tolist() for p in token_budget_split(samples, chunk, budget=24, header_lengths=headers)] == [[0, 1]]


def test_split_counts_a_shared_header_once():
    """A header runs once for all its rows: rows of one agent behind a 6-token header, each with a 2-token rest and a
    1-token reply, take 6 + rows x 3 positions, so a budget of 20 holds 4 of them (not 2 x 9 = 18, as if every row ran
    the header), and an agent with a long header gets as many positions per chunk as one whose prompts are mostly
    conversation (the peak does not depend on which agent's chunk runs)."""
    P, L, n = 10, 2, 6
    prompt_mask = (torch.arange(P).flip(0) < 8).long().expand(n, P)  # 8 prompt tokens: header 6 + rest 2
    response_mask = (torch.arange(L) < 1).long().expand(n, L)
    samples = TurnBatch(agent=torch.zeros(n, dtype=torch.long), prompt_ids=prompt_mask * 7, prompt_mask=prompt_mask,
                        response_ids=response_mask * 7, response_mask=response_mask)
    chunk, headers = torch.arange(n), torch.full((n,), 6)
    parts = token_budget_split(samples, chunk, budget=20, header_lengths=headers)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5]]  # 6 + 4 x 3 = 18 <= 20; 6 + 5 x 3 = 21 > 20
    assert [p.tolist() for p in token_budget_split(samples, chunk, budget=20)] == [[0, 1], [2, 3], [4, 5]]  # no sharing: 9 a row
    only_headers = samples.replace(prompt_mask=(torch.arange(P).flip(0) < 6).long().expand(n, P))  # nothing after the header
    assert [p.tolist() for p in token_budget_split(only_headers, chunk, budget=20, header_lengths=headers)] == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("algorithm", sorted(TRAINERS))
def test_gradient_does_not_depend_on_the_chunk_token_budget(random_model_dir, algorithm, monkeypatch):
    """The policy's and the critic's first-step gradients are the same (allclose) with no budget (one chunk) and
    with a budget that cuts each minibatch into several chunks, every one within the budget: the positions its
    forwards run (rows behind the shared headers, and the headers once), as measured on the forwards."""
    torch.manual_seed(0)
    team = make_team(random_model_dir)
    perturb_adapters(team, std=0.1)
    results, seen = {}, {}
    for budget in (None, "small"):
        if budget is None:
            trainer = trainer_class(algorithm)(team, AlgoConfig(algorithm_name=algorithm, group_size=4, ppo_epoch=1), steps_per_iteration=8)
            torch.manual_seed(0)
            buffer = fill_buffer(team, trainer=trainer)
            lengths = torch.tensor([1, 6, 2, 5, 3, 6, 1, 4])  # (T·E,) ragged replies
            ragged = (torch.arange(buffer.response_mask.shape[-1]) < lengths.view(2, 4, 1, 1)).long()  # (T, E, 1, L)
            buffer.response_mask = buffer.response_mask * ragged
            trainer.compute_advantages(buffer)
            policy_samples = buffer.agent_samples(0, trainer.token_level)
            critic_samples = buffer.critic_samples(trainer.token_level)
            rows = torch.arange(len(policy_samples.prompt_ids))
            budget_value = padded_tokens(policy_samples, rows) // 3  # about three chunks of the policy's minibatch
        else:
            trainer = trainer_class(algorithm)(
                team, AlgoConfig(algorithm_name=algorithm, group_size=4, ppo_epoch=1, max_chunk_tokens=budget_value), steps_per_iteration=8
            )
        chunks_seen = []
        original = trainer._minibatches

        def spy(samples, chunks_per_minibatch, original=original, chunks_seen=chunks_seen):
            out = original(samples, chunks_per_minibatch)
            chunks_seen.append([(samples, chunk) for minibatch in out for chunk in minibatch.chunks])
            return out

        trainer._minibatches = spy
        forwards = ForwardPositions(team, monkeypatch) if budget is not None else None
        results[budget] = [one_step_gradients(trainer, trainer.update_policy, "reasoner", policy_samples)]
        if trainer.uses_critic:  # GRPO has none
            results[budget].append(one_step_gradients(trainer, trainer.update_critic, critic_samples))
        seen[budget] = chunks_seen
        team.set_active(None)
    assert [len(call) for call in seen[None]] == [1, team.n_agents][: len(seen[None])]  # policy: 1 chunk, critic: one per agent
    for call, uncut in zip(seen["small"], seen[None]):
        assert len(call) > len(uncut)  # the budget cut the policy's and the critic's minibatches further
        assert sorted(torch.cat([c for _, c in call]).tolist()) == list(range(len(call[0][0].prompt_ids)))  # every row once
    single_rows = sum(len(c) == 1 for call in seen["small"] for _, c in call)
    assert len(forwards.chunks) == sum(len(call) for call in seen["small"])  # one rows' forward per chunk
    assert sum(n > budget_value for n in forwards.chunks) <= single_rows  # only a row alone may exceed the budget
    for ones, cut in zip(results[None], results["small"]):
        assert len(ones) == len(cut) > 0 and any(g.abs().sum() > 0 for g in ones)
        for a, b in zip(ones, cut):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_budget_must_be_positive():
    with pytest.raises(ValueError, match="--max_chunk_tokens must be"):
        AlgoConfig(max_chunk_tokens=0)


def test_a_budget_that_cuts_nothing_changes_nothing(random_model_dir):
    """A chunk budget wider than every minibatch (the default ``--max_chunk_mib`` on a small model) runs each
    minibatch exactly as no budget does: the same chunks in the same (shuffled) row order and role headers shared
    over a minibatch, so the gradients are bit-identical (a recorded seeded run reproduces)."""
    torch.manual_seed(0)
    team = make_team(random_model_dir)
    perturb_adapters(team, std=0.1)
    grads, chunks = {}, {}
    for name, algo in {"none": {"max_chunk_mib": 0}, "wide": {"max_chunk_tokens": 10**9}, "default": {}}.items():
        trainer = APPOTrainer(team, AlgoConfig(algorithm_name="APPO", ppo_epoch=1, num_mini_batch=2, **algo), steps_per_iteration=8)
        torch.manual_seed(0)
        buffer = fill_buffer(team, trainer=trainer)
        trainer.compute_advantages(buffer)
        policy_samples, critic_samples = buffer.agent_samples(0, False), buffer.critic_samples(False)
        torch.manual_seed(1)
        chunks[name] = [[c.tolist() for c in m.chunks] + [m.budget_cut] for m in trainer._minibatches(critic_samples, team.n_agents)]
        torch.manual_seed(2)
        grads[name] = one_step_gradients(trainer, trainer.update_policy, "reasoner", policy_samples)
        grads[name] += one_step_gradients(trainer, trainer.update_critic, critic_samples)
        team.set_active(None)
    assert trainer.chunk_tokens > 10_000  # the default on this small model cuts nothing
    assert chunks["wide"] == chunks["none"] == chunks["default"] and not any(m[-1] for m in chunks["none"])
    for other in ("wide", "default"):
        assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads[other]))


def test_the_default_budget_follows_the_model_and_device():
    """``--max_chunk_tokens`` wins; else ``--max_chunk_mib`` (1024 on CPU) over the estimated bytes a position
    keeps: fewer positions for a wider model, more under gradient checkpointing, a mixture of experts counted per
    expert a token visits; 0 is none; a config with no size to estimate from is a clear error."""
    from transformers import GPT2Config, PretrainedConfig, Qwen2Config

    from marft.algorithms.chunk_budget import CPU_CHUNK_MIB, bytes_per_position, chunk_token_budget

    cpu = torch.device("cpu")
    small = Qwen2Config(hidden_size=64, intermediate_size=192, num_hidden_layers=3)
    wide = Qwen2Config(hidden_size=768, intermediate_size=2304, num_hidden_layers=12)  # the memory suite's 85M model
    assert bytes_per_position(wide) == 12 * (8 * 768 + 4 * 2304) * 4  # 0.70 MiB: float32 values whatever the dtype
    assert bytes_per_position(wide, gradient_checkpointing=True) == (12 * 768 + 8 * 768 + 4 * 2304) * 4
    default = chunk_token_budget(AlgoConfig(), wide, cpu)
    assert default == CPU_CHUNK_MIB * 2**20 // bytes_per_position(wide) == 1456
    assert chunk_token_budget(AlgoConfig(), small, cpu) == 69905  # marft-tiny's shape: nothing cut
    assert chunk_token_budget(AlgoConfig(max_chunk_mib=512), wide, cpu) == default // 2
    assert chunk_token_budget(AlgoConfig(max_chunk_mib=0), wide, cpu) is None
    assert chunk_token_budget(AlgoConfig(max_chunk_mib=0, max_chunk_tokens=300), wide, cpu) == 300
    moe = Qwen2Config(hidden_size=768, intermediate_size=2304, num_hidden_layers=12)
    moe.moe_intermediate_size, moe.num_experts_per_tok = 1152, 4  # a token through 4 experts of 1152
    assert bytes_per_position(moe) == 12 * (8 * 768 + 4 * 1152 * 4) * 4
    gpt2 = GPT2Config(n_embd=256, n_layer=4)  # no intermediate size: 4 x hidden
    assert bytes_per_position(gpt2) == 4 * (8 * 256 + 4 * 1024) * 4
    with pytest.raises(ValueError, match="--max_chunk_tokens N, or none with --max_chunk_mib 0"):
        bytes_per_position(PretrainedConfig())
    with pytest.raises(ValueError, match="--max_chunk_mib must be"):
        AlgoConfig(max_chunk_mib=-1)


def test_on_a_gpu_the_default_is_a_quarter_of_its_memory(monkeypatch):
    """On CUDA the default ``--max_chunk_mib`` is the GPU's total memory over 4 (an 80 GiB GPU: 20 GiB, ~4,000
    positions of Qwen2.5-1.5B's shape, its bf16 counted as float32); on CPU it is fixed, whatever the machine's memory."""
    from types import SimpleNamespace

    from transformers import Qwen2Config

    from marft.algorithms.chunk_budget import CPU_CHUNK_MIB, chunk_token_budget, default_chunk_mib

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2**30))
    assert default_chunk_mib(torch.device("cuda", 0)) == 20 * 1024
    assert default_chunk_mib(torch.device("cpu")) == CPU_CHUNK_MIB
    qwen_1_5b = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28)
    assert 3900 < chunk_token_budget(AlgoConfig(), qwen_1_5b, torch.device("cuda", 0)) < 4100


def test_the_log_names_where_the_budget_came_from(capsys):
    """The run's log line says which flag (or device default) set the budget; a bad value is one clear line."""
    from marft.algorithms.chunk_budget import budget_source
    from marft.config import parse_config

    cpu = torch.device("cpu")
    assert budget_source(AlgoConfig(), cpu) == "--max_chunk_mib 1024, the CPU default"
    assert budget_source(AlgoConfig(max_chunk_mib=0), cpu) == "--max_chunk_mib 0"
    assert budget_source(AlgoConfig(max_chunk_mib=0, max_chunk_tokens=500), cpu) == "--max_chunk_tokens"
    with pytest.raises(SystemExit):
        parse_config(["--max_chunk_mib", "abc"])
    assert "invalid int or none value: 'abc'" in capsys.readouterr().err
