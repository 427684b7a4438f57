"""The critic: LoRA adapter(s) on the team's one base model plus a linear value head on the last hidden state.

The critic values each turn from the acting agent's own prompt (role header, private observation,
history). The role header is the same for a whole batch, so the critic runs it once and shares its
keys/values (:class:`~marft.agents.headers.RoleHeaderCache`). A role-free critic view of the global state
(``env.state()`` plus the cue) was tried on the earlier, arithmetic-bound version of ``relay_sum``: its
prompts are a third as long and it explained more of the return's variance (0.7 against 0.3), but
learning there was worse (0.43 against 0.88 success on the training tasks in 512 iterations).

``--critic_mode shared`` (CTDE) has one adapter ``critic`` valuing every agent's turns; ``per_agent`` has
``critic_<role>`` per agent, each valuing its own agent's turns only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from marft.agents.headers import RoleHeaderCache
from marft.types import TurnOutput

CRITIC_ADAPTER = "critic"


class Critic(nn.Module):
    """Value heads and the routing of each agent's turns to its critic adapter.

    Args:
        headers: the role-header cache (and, through it, the adapter bank, which holds the critic adapters).
        agent_critics: per agent, the name of the critic adapter that values its turns.
        hidden_size: the base model's hidden size.
        device: where the value heads live (float32).
        merge_lora_in_rollout: :meth:`value_batches` (the rollout's values) runs each critic folded into the base
            weights (``AdapterBank.merged``, float32 only).
    """

    def __init__(self, headers: RoleHeaderCache, agent_critics: Sequence[str], hidden_size: int, device, merge_lora_in_rollout: bool = False):
        super().__init__()
        self.headers = headers
        self.merge_lora_in_rollout = merge_lora_in_rollout
        self.agent_critics = list(agent_critics)
        """Per agent, the critic adapter that values its turns."""
        self.adapters = list(dict.fromkeys(self.agent_critics))
        """The critic adapters, once each."""
        self.value_heads = nn.ModuleDict()
        """Per critic adapter, its linear value head on the last hidden state."""
        for critic in self.adapters:
            head = nn.Linear(hidden_size, 1, device=device, dtype=torch.float32)
            nn.init.normal_(head.weight, std=1.0 / hidden_size)
            nn.init.zeros_(head.bias)
            self.value_heads[critic] = head

    @property
    def value_head(self) -> nn.Linear | None:
        """The shared critic's value head (``--critic_mode shared``), else None."""
        return self.value_heads[CRITIC_ADAPTER] if CRITIC_ADAPTER in self.value_heads else None

    def trainable_parameters(self, critic: str | None = None) -> list[nn.Parameter]:
        """One critic's adapter and value head, or every critic's."""
        bank = self.headers.bank
        return [p for c in ([critic] if critic else self.adapters) for p in bank.parameters(c) + list(self.value_heads[c].parameters())]

    def agents_of(self, critic: str) -> list[int]:
        """The agents whose turns ``critic`` values."""
        return [agent for agent, c in enumerate(self.agent_critics) if c == critic]

    def adapter_for(self, agent: int | torch.Tensor | None, critic: str | None = None) -> str:
        """``critic`` when given, else the critic of ``agent`` (or of every row's agent, a ``(B,)`` tensor:
        they must share it), else the only one."""
        if critic is not None:
            return critic
        if agent is not None:
            agents = [agent] if isinstance(agent, int) else sorted(set(agent.tolist()))
            critics = sorted({self.agent_critics[a] for a in agents})
            if len(critics) == 1:
                return critics[0]
            raise ValueError(f"agents {agents} are valued by different critics {critics}: value them one critic at a time")
        if len(self.adapters) != 1:
            raise ValueError(f"say which critic values these prompts: the team has {self.adapters}")
        return self.adapters[0]

    def states(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor | None = None,
        response_mask: torch.Tensor | None = None,
        agent: int | torch.Tensor | None = None,
        critic: str | None = None,
        tail: int = 1,
    ) -> torch.Tensor:
        """A critic's last hidden states at the last ``tail`` columns of a prompt batch (and replies).
        (B, P)[, (B, L)] → (B, tail, H) (the rest of the last layer is skipped, :meth:`RoleHeaderCache.decoder_states`).

        With ``agent`` (one agent, or each row's agent as a ``(B,)`` tensor), the prompts are those agents':
        their critic runs them (unless ``critic`` names one), each role header is run once for the batch
        (with its gradient summed over its rows in an update) and the B prompts cost only what comes after
        it. S may then be shorter than P + L, but the last columns are the same positions either way: index
        from the end.
        """
        self.headers.bank.route(self.adapter_for(agent, critic))
        cache = None
        if agent is not None:
            agents = torch.full((len(prompt_ids),), agent, dtype=torch.long) if isinstance(agent, int) else agent
            cache, prompt_ids, prompt_mask = self.headers.rows_behind_headers(agents, prompt_ids, prompt_mask, by_layer=self.headers.reads_by_layer)
        if response_ids is not None:
            prompt_ids = torch.cat([prompt_ids, response_ids], dim=1)  # (B, P + L)
            prompt_mask = torch.cat([prompt_mask, response_mask], dim=1)
        return self.headers.decoder_states(cache, prompt_ids, prompt_mask, tail=tail)

    def values(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, agent: int | torch.Tensor | None = None, critic: str | None = None
    ) -> torch.Tensor:
        """V(prompt) from the last prompt token's hidden state. (B, P) → (B,).

        ``agent``: the prompts are that agent's, or each row's agent's (``(B,)``): valued by their critic, each
        role header run once for the batch (:meth:`states`); ``critic``: the critic to use on prompts of any agents (needed with per-agent critics)."""
        critic = self.adapter_for(agent, critic)
        hidden = self.states(prompt_ids, prompt_mask, agent=agent, critic=critic, tail=1)  # (B, 1, H)
        return self.value_heads[critic](hidden[:, -1].float()).squeeze(-1)  # (B,)

    def token_values(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        response_ids: torch.Tensor,
        response_mask: torch.Tensor,
        agent: int | torch.Tensor | None = None,
        critic: str | None = None,
    ) -> torch.Tensor:
        """Token-level critic: the value before each reply token, from the exact sampled ids.

        ``[:, 0]`` equals :meth:`values` of the prompt. (B, P), (B, L) → (B, L), zero at padding.
        """
        L = response_ids.shape[1]
        critic = self.adapter_for(agent, critic)
        hidden = self.states(prompt_ids, prompt_mask, response_ids, response_mask, agent, critic, tail=L + 1)[:, :-1]  # (B, L, H): before token t
        return self.value_heads[critic](hidden.float()).squeeze(-1) * response_mask  # (B, L)

    @torch.no_grad()
    def value_batches(self, batches: Sequence[tuple[int, TurnOutput]], token_values: bool = False) -> None:
        """Critic values of turn batches, ``(agent, TurnOutput)`` each: fills every batch's ``values (B,)`` and,
        with ``token_values``, ``token_values (B, L)``.

        Per critic, one forward for the role headers of the agents it values and one for all their batches'
        prompts (and replies) behind them: the critic's cost per step does not grow in forward calls with the
        team size (per-agent critics: one such pair per critic, over its agent's batches)."""
        for critic in self.adapters:
            mine = [(agent, turn) for agent, turn in batches if self.agent_critics[agent] == critic]
            if not mine:
                continue
            self.headers.bank.route(critic)
            L = mine[0][1].response_ids.shape[1] if token_values else 0
            with self.headers.bank.merged_if(critic, self.merge_lora_in_rollout):  # the header and prompt forwards
                cache, ids, mask = self.headers.behind_headers(
                    [(a, t.prompt_ids, t.prompt_mask) for a, t in mine], by_layer=self.headers.reads_by_layer)  # (ΣB, Hmax + S)
                if token_values:
                    ids = torch.cat([ids, torch.cat([t.response_ids for _, t in mine])], dim=1)  # (ΣB, Hmax + S + L)
                    mask = torch.cat([mask, torch.cat([t.response_mask for _, t in mine])], dim=1)
                hidden = self.headers.decoder_states(cache, ids, mask, tail=L + 1)  # (ΣB, L + 1, H)
            values = self.value_heads[critic](hidden.float()).squeeze(-1)  # (ΣB, L + 1): before each reply token, then after
            for (_, turn), rows in zip(mine, values.split([len(t.prompt_ids) for _, t in mine])):
                turn.values = rows[:, 0]  # the value of the prompt (also for empty replies)
                if token_values:
                    turn.token_values = rows[:, :L] * turn.response_mask  # (B, L)
