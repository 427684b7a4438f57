"""A TextArena env's warm-start demonstrations: random legal play (or another player's moves), each move prompted
exactly as training prompts it (:meth:`marft.envs.textarena.env.TextArenaEnv.demonstrations`)."""

from __future__ import annotations


def random_legal_demonstrations(env, n: int, choose=None, recovery_share: float = 0.0) -> list[dict]:
    """``n`` one-move transcripts of random legal play (both seats), in the game's own move format, each prompted
    exactly as training prompts that move (played through this env): a warm start towards legal play.
    ``choose(state) -> move``: another player's moves instead (e.g. ``scripts/tictactoe_expert.py``'s best player).
    ``recovery_share``: the share of moves made after a rejected attempt: the mover first slips (:func:`slip`,
    where the game forgives it) and the transcript is its move from the retry's prompt, which shows the rejected
    move and the game's reason, so the warm start also shows what to do once a move is rejected (0: none, and the
    same draws as without it)."""
    if not 0.0 <= recovery_share <= 1.0:
        raise ValueError(f"recovery_share must be in [0, 1], got {recovery_share!r}")
    transcripts = []
    while len(transcripts) < n:
        index = env.choose_task(None)
        env.reset(options={"task_index": index})
        if not env.episode.legal:
            raise ValueError(f"{env.game_id} neither lists its legal moves (a line with 'available' and moves in quotes like "
                             "'[4]') nor has a reader of them (marft.envs.textarena.legal), so there are no random-legal "
                             "demonstrations: warm-start with transcripts of your "
                             "own (--sft_data FILE.jsonl)")
        while not env.episode.done and env.episode.legal and len(transcripts) < n:
            mover = env.speakers()[0]
            if recovery_share and env.np_random.random() < recovery_share:
                slip(env, mover)
            move = choose(env.episode) if choose else env.episode.legal[int(env.np_random.integers(len(env.episode.legal)))]
            if env.self_play:  # the mover's view is its private observation; the history names the game
                row = {"problem": env.game_id, "private": {env.roles[mover]: env.episode.views[mover]}}
            else:  # the view is the history (format_problem(view))
                row = {"problem": env.episode.history.removeprefix("Problem: ").rstrip("\n")}
            heads = env.kept_heads()
            speakers = say(env, move)
            row["kept_heads"] = {env.roles[a]: heads[a] for a in speakers}  # what a cut keeps, as in training
            transcripts.append({**row, "turns": [{"role": env.roles[a], "text": move} for a in speakers], "task": index})
    return transcripts


def slip(env, mover: int) -> None:
    """Agent ``mover`` (to move now) tries an invalid move, if the game forgives it: one of the game's earlier
    moves that is not legal now (e.g. a taken cell), or a legal move cut short (e.g. ``[4``, a reply that ended too
    soon), drawn with ``np_random``. Else (no candidate, or the game would not forgive it) nothing happens."""
    state = env.episode
    candidates = [m for m in dict.fromkeys(state.moves) if m not in state.legal]
    candidates += [m[:-1] for m in state.legal if len(m) > 1 and m[:-1] not in state.legal]
    if not candidates:
        return
    attempt = candidates[int(env.np_random.integers(len(candidates)))]
    probe = env._game(state.game_seed, state.moves)  # a replay: the game may take what looks invalid (TextArena adds brackets)
    probe.move(attempt)
    if probe.forgiven:
        say(env, attempt)


def say(env, move: str) -> list[int]:
    """The team plays ``move`` as this team step: the agent to move says it; in a puzzle, every agent in its
    workflow's turn (the answering one's reply is the move), so a warm start shows the team proposing a move and
    the answering agent playing it. Returns who spoke, in order."""
    speakers = []
    while (due := env.speakers()) and (env.puzzle or not speakers):
        env.take_turn(due[0], move)
        speakers.append(due[0])
    env.step(env.turn_actions())
    return speakers
