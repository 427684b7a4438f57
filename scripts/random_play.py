"""Random legal play against random legal play in a two-player TextArena game: the baseline a trained player's win
rate against the random player is read against (seats rotated, that is the mean of the two seats' win rates).

    python scripts/random_play.py --game ConnectFour-v0 --games 1000

Each game has its own seed (0 .. games-1) for the deal and for both players' draws. The legal moves come from the
game's messages or marft's reader of its state (``marft.envs.textarena.legal``); a game with neither is refused.
Prints one line of JSON: each seat's win rate, the draws, and the win rate over both seats.
"""

import argparse
import json
import random

import textarena

from marft.envs.textarena.legal import legal_moves


def play(game_id: str, seed: int) -> dict:
    """One game of random legal moves on both sides → TextArena's rewards per player."""
    env = textarena.make(game_id)
    env.reset(num_players=2, seed=seed)
    base = env
    while hasattr(base, "env"):  # the game itself, under TextArena's wrappers
        base = base.env
    rng, done = random.Random(seed), False
    while not done:
        player, messages = env.get_observation()
        text = messages if isinstance(messages, str) else "\n".join(str(m[1]) for m in messages)
        moves = legal_moves(base, player, text)
        if not moves:
            raise SystemExit(f"{game_id}: no legal moves known for player {player} (neither listed nor read from the game's state)")
        done, _ = env.step(rng.choice(moves))
    rewards, _ = env.close()
    return rewards


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--game", default="ConnectFour-v0", help="a two-player TextArena game id")
    parser.add_argument("--games", type=int, default=1000, help="games to play (seeds 0 .. games-1)")
    args = parser.parse_args(argv)
    wins, draws = [0, 0], 0
    for seed in range(args.games):
        rewards = play(args.game, seed)
        if rewards[0] == rewards[1]:
            draws += 1
        else:
            wins[max(rewards, key=rewards.get)] += 1
    result = {"game": args.game, "games": args.games, "first_player_wins": wins[0] / args.games, "second_player_wins": wins[1] / args.games,
              "draws": draws / args.games, "over_both_seats": (wins[0] + wins[1]) / (2 * args.games)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
