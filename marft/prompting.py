"""How the shared conversation is written down as text.

One plain-text format is used everywhere (environments, the agent team, the
tiny model's warm-start data), so an agent's prompt is always::

    <role header>            # the agent's system prompt, never truncated
    <private observation>    # what only this agent sees (optional), never truncated
    Problem: <problem>\n     # \
    <Role>: <reply>\n        #  | the shared history (environment observation)
    Judge: <feedback>\n      # /  plus this step's earlier replies
    <Role>:                  # the generation cue for this agent

With ``--chat_template auto`` and a tokenizer that has a chat template (instruct models),
``marft.agents.prompts.PromptEncoder`` renders the same parts as one chat per agent turn:
the role header is the system message, the private observation and the conversation
(without the cue, followed by :func:`handover_text`) are one user message, and the reply is
the assistant turn. A transcript shared by several agents has no single "assistant", so the
other agents' replies stay plain ``<Role>: <reply>`` lines inside the user message.
"""

from __future__ import annotations

JUDGE_ROLE = "Judge"
HOST_ROLE = "Host"
"""Speaks the handover lines of orchestrated workflows ("Host: Now it is Solver's turn."); no agent may take it."""


def format_problem(problem: str) -> str:
    """The first line(s) of every shared history."""
    return f"Problem: {problem.strip()}\n"


def format_turn(role: str, text: str) -> str:
    """One finished turn of the shared history: ``"<role>: <text>\\n"``."""
    return f"{role}: {text.strip()}\n"


def handover_text(role: str) -> str:
    """The line the host writes before a specialist the orchestrator called speaks."""
    return f"Now it is {role}'s turn."


def format_cue(role: str) -> str:
    """The text that asks ``role`` to speak next (no trailing space)."""
    return f"{role}:"


def format_header(system_prompt: str) -> str:
    """An agent's role header: its system prompt followed by a blank line, or nothing."""
    system_prompt = system_prompt.strip()
    return f"{system_prompt}\n\n" if system_prompt else ""


def format_private(text: str) -> str:
    """An agent's private observation (e.g. a hidden key only it may see), or nothing."""
    text = text.strip()
    return f"{text}\n\n" if text else ""


def format_conversation(history: str, earlier_turns: list[tuple[str, str]]) -> str:
    """The shared history followed by this step's earlier replies (what every agent of the step reads)."""
    return history + "".join(format_turn(r, t) for r, t in earlier_turns)


def build_prompt(system_prompt: str, history: str, earlier_turns: list[tuple[str, str]], role: str) -> tuple[str, str]:
    """Split an agent's prompt into ``(header, body)``.

    ``header`` is kept whole when the prompt is too long; ``body`` is cut from the left.

    Args:
        system_prompt: the agent's prompt from the profile ("" for anonymous teams).
        history: the environment's observation (problem plus earlier steps' turns).
        earlier_turns: ``(role, reply)`` of the agents that already spoke in this step.
        role: the role name of the agent about to speak.
    """
    body = format_conversation(history, earlier_turns) + format_cue(role)
    return format_header(system_prompt), body
