"""scripts/tictactoe_expert.py: the best player against the random-legal-move player, and its demonstrations."""

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
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


@pytest.mark.parametrize("name", ["fixed order", "win, else block", "best"])
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
    assert figures["all"] == {"positions": len(problems), "argmax_best": 1.0, "p_best": 1.0, "value_lost": 0.0, "p_taken": 0.0}
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
