"""``scripts/selfplay_benchmark.py``: the self-play recipe as its commands, and each agent's figures against the random player."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import selfplay_benchmark  # noqa: E402

pytest.importorskip("textarena", reason="textarena is not installed (pip install -r requirements-dev.txt)")


def test_wins_over_both_seats_weighs_each_seat_by_its_games():
    games = {"seat_0": {"win": 0.5, "games": 3}, "seat_1": {"win": 0.0, "games": 1}}
    assert selfplay_benchmark.wins_over_both_seats(games) == pytest.approx(1.5 / 4)


def test_the_steps_are_the_guides_commands_with_the_training_flags_on_marft_train_only():
    args, extra = selfplay_benchmark.parse_args(["--seed", "2", "--output_dir", "out", "--invalid_move_penalty", "1"])
    steps = selfplay_benchmark.commands(args, extra)
    assert list(steps) == ["sft", "before_a", "before_b", "train", "after_a", "after_b"]
    assert "--invalid_move_penalty" in steps["train"] and not any("--invalid_move_penalty" in s for n, s in steps.items() if n != "train")
    assert steps["sft"][steps["sft"].index("--seed") + 1] == "2" == steps["train"][steps["train"].index("--seed") + 1]
    # each agent is evaluated with the random player in the other agent's seat
    assert steps["before_a"][steps["before_a"].index("--versus_random") + 1] == "Player B"
    assert steps["after_b"][steps["after_b"].index("--versus_random") + 1] == "Player A"
    guide = (ROOT / "docs" / "selfplay.md").read_text()
    assert " ".join(selfplay_benchmark.SELF_PLAY_FLAGS.split()) in " ".join(guide.replace("\\\n", " ").split()), \
        "the script's self-play flags are the guide's $SELF_PLAY"


@pytest.mark.slow
def test_the_json_line_holds_each_agents_win_rate_from_its_evaluation_games(random_model_dir, tmp_path, capsys):
    out = tmp_path / "selfplay"
    result = selfplay_benchmark.main(["--model_name_or_path", random_model_dir, "--sft_steps", "2", "--n_demonstrations", "16",
                                      "--n_rollout_threads", "4", "--num_env_steps", "40", "--episodes", "4", "--output_dir", str(out),
                                      "--invalid_move_penalty", "1", "--eval_episodes", "2", "--n_eval_threads", "2"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    for name, role in (("before_a", "Player A"), ("before_b", "Player B"), ("after_a", "Player A"), ("after_b", "Player B")):
        games = [json.loads(line) for line in (out / "eval" / name / "transcripts.jsonl").read_text().splitlines()]
        assert len(games) == 4 and {g["seat"] for g in games} == {0, 1}
        assert result[name] == pytest.approx(sum(g["outcome_by_role"][role] == "win" for g in games) / 4, abs=1e-4)
        assert result[f"{name}_invalid"] == pytest.approx(sum(bool(g["invalid_move"]) for g in games) / 4)
    assert json.loads((out / "rl" / "config.json").read_text())["env"]["invalid_move_penalty"] == 1.0
    assert (out / "eval" / "after_a" / "summary.json").is_file() and "steps_1" in \
        json.loads((out / "eval" / "after_a" / "summary.json").read_text())["checkpoint"]
