"""scripts/tictactoe_expert.py: the best player against the random-legal-move player, and its demonstrations."""

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("tictactoe_expert", ROOT / "scripts" / "tictactoe_expert.py")
expert = importlib.util.module_from_spec(spec)
spec.loader.exec_module(expert)


def test_random_play_matches_the_known_exact_figures():
    """Random against random: the first player wins 737/1260 of games, the second 363/1260 (the classic count)."""
    random = expert.SIMPLE_POLICIES["random"]
    assert expert.policy_win_rate(random, 0) == pytest.approx(737 / 1260, abs=1e-12)
    assert expert.policy_win_rate(random, 1) == pytest.approx(363 / 1260, abs=1e-12)


def simulate(policy, me: int, games: int, rng) -> float:
    """A plain reference: play the games out, the opponent uniformly random."""
    wins = 0
    for _ in range(games):
        board, to_move = (0,) * 9, 0
        while not expert.winner(board) and expert.empty_cells(board):
            options = policy(board, me) if to_move == me else expert.empty_cells(board)
            board = expert.play(board, options[rng.integers(len(options))], to_move)
            to_move = 1 - to_move
        wins += expert.winner(board) == me + 1
    return wins / games


@pytest.mark.parametrize("name", ["fixed order", "win, else fixed order", "win, else block", "best"])
def test_exact_win_rates_agree_with_played_out_games(name):
    policy, rng = expert.SIMPLE_POLICIES[name], np.random.default_rng(0)
    for me in (0, 1):
        exact = expert.policy_win_rate(policy, me)
        assert simulate(policy, me, 4000, rng) == pytest.approx(exact, abs=0.025)  # 4000 games: ~3.5 standard errors


def test_the_best_player_is_at_least_as_good_as_every_other_policy_from_every_position():
    best = expert.SIMPLE_POLICIES["best"]
    for me in (0, 1):
        assert expert.policy_win_rate(best, me) == pytest.approx(expert.win_probability((0,) * 9, 0, me))
        for name, policy in expert.SIMPLE_POLICIES.items():
            assert expert.policy_win_rate(policy, me) <= expert.policy_win_rate(best, me) + 1e-12, name
    # from a position where one move wins at once, that move is the only best one (seat 0: O on 0 and 1, X on 3 and 4)
    assert expert.best_cells((1, 1, 0, 2, 2, 0, 0, 0, 0), 0) == [2]


@pytest.mark.parametrize("view", ["since_move", "board"])
def test_demonstrations_are_the_best_move_of_the_position_the_prompt_shows(tmp_path, view):
    pytest.importorskip("textarena", reason="textarena is not installed (pip install -r requirements-dev.txt)")
    out = tmp_path / "expert.jsonl"
    result = expert.main(["--demonstrations", "40", "--out", str(out), "--game_view", view])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["demonstrations"] == len(rows) == 40
    boards_shown = {row["problem"].count("Current Board:") for row in rows}
    assert (boards_shown == {1}) if view == "board" else (2 in boards_shown)
    assert result["win_rate_against_random"]["best"]["both"] == pytest.approx(0.9667, abs=1e-4)
    for row in rows:
        problem, (turn,) = row["problem"], row["turns"]
        board, seat = expert.board_in_prompt(problem)  # the latest board as the prompt shows it: digits free, O player 0, X player 1
        assert turn["role"] == "Player" and re.fullmatch(r"\[\d\]", turn["text"])
        assert int(turn["text"][1]) in expert.best_cells(board, seat)
        assert f"'{turn['text']}'" in problem.rsplit("Available Moves:", 1)[1]  # legal in the prompt's own list


def test_grading_compares_the_checkpoints_likeliest_move_with_the_best_ones(monkeypatch, tmp_path):
    """The figures from given move probabilities (no model): the best player's own scores perfectly, a player that
    always plays an occupied cell gives away each position's whole value; positions split by seat and seen/unseen."""
    pytest.importorskip("textarena", reason="textarena is not installed (pip install -r requirements-dev.txt)")
    import torch

    from marft.config import TrainConfig

    config = TrainConfig()
    monkeypatch.setattr("marft.trained.evaluate.checkpoint_config", lambda path: (config, path))
    with pytest.raises(ValueError, match="scores Tic-Tac-Toe players"):
        expert.grade("ckpt", 30, seed=5)  # the default env, relay_sum
    config.env.env_name, config.env.game_view = "textarena:TicTacToe-v0", "board"
    rows = expert.demonstrations(30, seed=5, view="board")
    problems = sorted({row["problem"] for row in rows})
    data = tmp_path / "seen.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows[:10]))

    def best_player(checkpoint, prompts, heads=None):
        probs = torch.zeros(len(prompts), 9)
        for i, problem in enumerate(prompts):
            best = expert.best_cells(*expert.board_in_prompt(problem))
            probs[i, best] = 1 / len(best)
        return probs.clamp(min=1e-12).log()

    monkeypatch.setattr(expert, "cell_log_probs", best_player)
    figures = expert.grade("ckpt", 30, seed=5, sft_data=str(data))
    assert {k: figures["all"][k] for k in ("positions", "argmax_best", "p_best", "value_lost", "p_taken")} == {
        "positions": len(problems), "argmax_best": 1.0, "p_best": 1.0, "value_lost": 0.0, "p_taken": 0.0}
    # takes_win / blocks: where the player (its likeliest move: the first of the best player's ties) completes its own line / the opponent's
    boards = [expert.board_in_prompt(p) for p in problems]
    can_win = [b for b in boards if expert.completing(b[0], b[1])]
    must_block = [b for b in boards if not expert.completing(b[0], b[1]) and expert.completing(b[0], 1 - b[1])]
    assert (figures["all"]["win_positions"], figures["all"]["block_positions"]) == (len(can_win), len(must_block)) and can_win
    took = [float(min(expert.best_cells(*b)) in expert.completing(b[0], b[1])) for b in can_win]
    blocked = [float(min(expert.best_cells(*b)) in expert.completing(b[0], 1 - b[1])) for b in must_block]
    assert figures["all"]["takes_win"] == pytest.approx(np.mean(took), abs=1e-4) and 0 < np.mean(took)
    assert figures["all"]["blocks"] == (pytest.approx(np.mean(blocked), abs=1e-4) if must_block else None)
    assert figures["seat_0"]["positions"] + figures["seat_1"]["positions"] == len(problems)
    seen = {row["problem"] for row in rows[:10]}
    assert (figures["seen"]["positions"], figures["unseen"]["positions"]) == (len(seen), len(problems) - len(seen))

    def occupied_cell(checkpoint, prompts, heads=None):
        probs = torch.full((len(prompts), 9), 1e-9)
        for i, problem in enumerate(prompts):
            board, _ = expert.board_in_prompt(problem)
            probs[i, next((c for c in range(9) if board[c]), 0)] = 1.0
        return probs.log()

    monkeypatch.setattr(expert, "cell_log_probs", occupied_cell)
    figures = expert.grade("ckpt", 30, seed=5)
    taken = [p for p in problems if any(expert.board_in_prompt(p)[0])]
    lost = [expert.move_value(*expert.board_in_prompt(p)[:1], expert.best_cells(*expert.board_in_prompt(p))[0],
                              expert.board_in_prompt(p)[1]) for p in taken]
    assert "seen" not in figures and figures["all"]["p_taken"] == pytest.approx(len(taken) / len(problems), abs=1e-4)
    assert figures["all"]["takes_win"] == 0.0 and figures["all"]["blocks"] in (0.0, None)  # an occupied cell neither wins nor blocks
    assert figures["all"]["value_lost"] == pytest.approx(sum(lost) / len(problems), abs=1e-4)  # the empty board: cell 0 may be best
    with pytest.raises(ValueError, match="no 3x3 board"):
        expert.board_in_prompt("You are Player 0 in Tic Tac Toe.\n[GAME] Current Board:\n\n 0 | 1 \n\nAvailable Moves: '[0]'")


@pytest.mark.slow
def test_the_cells_scores_are_the_policys_own(random_model_dir, tmp_path):
    """cell_log_probs (the warm start's scorer) against the RL scorer (``AgentTeam.response_logprobs``) on a warm-started
    checkpoint: the same nine log-probabilities per position, normalised."""
    pytest.importorskip("textarena", reason="textarena is not installed (pip install -r requirements-dev.txt)")
    import torch

    from marft.cli.sft import main as sft_main
    from marft.prompting import format_problem
    from marft.trained.evaluate import checkpoint_config, load_team

    run = tmp_path / "sft"
    assert sft_main(["--model_name_or_path", random_model_dir, "--env_name", "textarena:TicTacToe-v0", "--profile_path", "game_player",
                     "--max_new_tokens", "4", "--context_window", "512", "--game_view", "board", "--sft_steps", "2",
                     "--n_demonstrations", "8", "--output_dir", str(run)]) == 0
    problems = sorted({row["problem"] for row in expert.demonstrations(6, seed=3, view="board")})
    scores = expert.cell_log_probs(str(run), problems, batch_positions=2)
    assert scores.shape == (len(problems), 9) and torch.allclose(scores.exp().sum(-1), torch.ones(len(problems)))
    config, path = checkpoint_config(run)
    team, _, _ = load_team(config, path)
    replies = torch.tensor([team.prompts.encode_reply(f"[{cell}]")[:4] for cell in range(9)])  # (9, L), cut as the warm start cuts
    with torch.no_grad():
        for i, problem in enumerate(problems):
            ids, mask = team.encode_prompts(0, [format_problem(problem)], [[]])
            logprobs = team.response_logprobs(team.agent_adapters[0], ids.repeat(9, 1), mask.repeat(9, 1), replies,
                                              torch.ones_like(replies)).logprobs.sum(-1)  # (9,)
            assert torch.allclose(torch.log_softmax(logprobs, -1), scores[i], atol=1e-4)
    summary = expert.main(["--grade", str(run), "--positions", "6", "--grade_seed", "3"])["grade"]
    assert summary["all"]["positions"] == len(problems) and 0.0 <= summary["all"]["p_best"] <= 1.0


def test_a_players_own_games_are_scored_position_by_position(tmp_path):
    """--games: hand-made games with a missed win, a block after a forgiven invalid try, and the figures they give."""
    games = [
        # seat 0 (O): [0], X [3], [1], X [4]; now [2] wins (and X threatens [5]): it plays [8], X wins at [5]
        {"seat": 0, "game_moves": ["[0]", "[3]", "[1]", "[4]", "[8]", "[5]"]},
        # seat 1 (X): O [0], [4], O [1]; a try at the taken [1], then the block at [2]
        {"seat": 1, "game_moves": ["[0]", "[4]", "[1]", "[ 1 ]", "[2]"]},
    ]
    path = tmp_path / "transcripts.jsonl"
    path.write_text("".join(json.dumps(g) + "\n" for g in games))
    figures = expert.game_mistakes(str(path))
    first, second = figures["seat_0"], figures["seat_1"]
    assert (first["games"], first["positions_to_win"], first["takes_win"], first["positions_to_block"], first["blocks"]) == (1, 1, 0.0, 0, None)
    lost = 1.0 - expert.move_value((1, 1, 0, 2, 2, 0, 0, 0, 0), 8, 0)  # the win it missed, the only position that lost value
    assert first["value_lost"] == pytest.approx(lost / 3, abs=1e-4) and first["invalid_tries"] == 0.0
    assert (second["positions_to_block"], second["blocks"], second["best_blocks"], second["invalid_tries"]) == (1, 1.0, 1.0, 1.0)
    assert second["positions_to_win"] == 0 and second["takes_win"] is None
    (tmp_path / "old.jsonl").write_text(json.dumps({"seat": 0, "steps": []}) + "\n")
    with pytest.raises(ValueError, match="game_moves"):
        expert.game_mistakes(str(tmp_path / "old.jsonl"))
    with pytest.raises(SystemExit) as stopped:  # from the command line: one line and exit status 2
        expert.main(["--games", str(tmp_path / "missing.jsonl")])
    assert stopped.value.code == 2
