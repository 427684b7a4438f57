"""Per-role diagnostics: what each role does in the rollouts, whom the orchestrator calls, and transcripts.

A team that routes is opaque without them: TensorBoard gets, per role, its turns per team step, reply
length, mean advantage (the trainer adds entropy and KL per agent), the orchestrator's calls per role, and
each evaluation's transcripts (JSONL in the run directory and TensorBoard text) with the speaking role on
every turn.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from marft.envs.workflows import StepTurns


class TeamDiagnostics:
    """Counts the orchestrator's calls and invalid replies, and summarises a rollout buffer per role.

    Args:
        roles: every agent's role, in profile order.
    """

    def __init__(self, roles: Sequence[str]):
        self.roles = list(roles)
        self.calls = {"train": Counter(), "eval": Counter()}  # role -> calls since the last report
        self.steps = {"train": 0, "eval": 0}  # team steps counted since the last report
        self.invalid = {"train": 0, "eval": 0}

    def count_step(self, steps: Sequence[StepTurns], evaluation: bool = False) -> int:
        """Count the calls of finished team steps (before the envs grade them); return how many of them ended on
        an invalid orchestrator reply."""
        phase = "eval" if evaluation else "train"
        invalid = sum(int(turns.invalid) for turns in steps)
        for turns in steps:
            self.calls[phase].update(self.roles[a] for a in turns.calls)
        self.invalid[phase] += invalid
        self.steps[phase] += len(steps)
        return invalid

    def reset(self, phase: str) -> None:
        """Forget the calls counted in ``phase`` ("train" or "eval")."""
        self.calls[phase], self.steps[phase], self.invalid[phase] = Counter(), 0, 0

    def _orchestrator_stats(self, phase: str, prefix: str) -> dict[str, float]:
        steps = max(self.steps[phase], 1)
        out = {}
        if self.calls[phase] or self.invalid[phase]:
            out = {f"{prefix}/calls_per_step_{role}": self.calls[phase][role] / steps for role in self.roles}
            out[f"{prefix}/invalid_share"] = self.invalid[phase] / steps
        self.reset(phase)
        return out

    def rollout_stats(self, buffer, token_level: bool = False) -> dict[str, float]:
        """Per role, from a buffer whose advantages are computed: ``roles/<role>/turns_per_step``,
        ``reply_tokens``, ``advantage`` (``token_level``: the mean over its real reply tokens) and
        ``zero_advantage_share`` (the share of its turns whose advantage is exactly 0: turns that cannot move
        the policy, e.g. GRPO groups whose returns are all equal); over all roles ``charts/zero_advantage_share``;
        the orchestrator's calls per role since the last report."""
        out = {}
        env_steps = max(int(buffer.active.sum()), 1)
        lengths = buffer.response_mask.sum(-1).float()  # (T, E, S)
        if token_level:  # a turn carries no signal when every real reply token's advantage is 0
            zero = ((buffer.token_advantages != 0) & buffer.response_mask.bool()).sum(-1) == 0  # (T, E, S)
        else:
            zero = buffer.advantages == 0  # (T, E, S)
        played = buffer.played  # (T, E, S)
        if played.any():
            out["charts/zero_advantage_share"] = float(zero[played].float().mean())
        for agent, role in enumerate(self.roles):
            mine = buffer.agent == agent  # (T, E, S)
            count = int(mine.sum())
            out[f"roles/{role}/turns_per_step"] = count / env_steps
            if not count:
                continue
            out[f"roles/{role}/reply_tokens"] = float(lengths[mine].mean())
            out[f"roles/{role}/zero_advantage_share"] = float(zero[mine].float().mean())
            if token_level:
                mask = buffer.response_mask[mine].bool()
                out[f"roles/{role}/advantage"] = float(buffer.token_advantages[mine][mask].mean()) if mask.any() else 0.0
            else:
                out[f"roles/{role}/advantage"] = float(buffer.advantages[mine].mean())
        out.update(self._orchestrator_stats("train", "orchestrator"))
        return out

    def evaluation_stats(self) -> dict[str, float]:
        """The orchestrator's calls per role per team step in the last evaluation (``eval_orchestrator/...``)."""
        return self._orchestrator_stats("eval", "eval_orchestrator")

    def call_distribution(self, phase: str = "eval") -> dict[str, float]:
        """Per role, its calls per team step counted so far in ``phase`` (the last evaluation's for "eval"), and
        ``invalid``: the share of steps that ended on an invalid orchestrator reply; empty when nothing was counted."""
        steps = self.steps[phase]
        if not (self.calls[phase] or self.invalid[phase]) or not steps:
            return {}
        return {**{role: self.calls[phase][role] / steps for role in self.roles}, "invalid": self.invalid[phase] / steps}


def write_transcripts(path: Path, episodes: list[dict], shown: int = 3) -> str:
    """Write ``episodes`` as JSONL to ``path``; return the first ``shown`` as Markdown (for TensorBoard text)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for episode in episodes:
            f.write(json.dumps(episode) + "\n")
    parts = []
    for episode in episodes[:shown]:
        lines = [f"**episode {episode['episode']}** ({'correct' if episode['correct'] else 'wrong'}): {episode['problem']}"]
        for n, step in enumerate(episode["steps"]):
            lines += [f"- step {n + 1}, **{turn['role']}**: {turn['text']}" for turn in step]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)

