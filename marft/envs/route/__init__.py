"""``route``: the orchestration toy task (:mod:`.env`). The names of the old module ``marft.envs.route`` are here
too, so its imports keep working."""

from marft.envs.route.env import SHELVES, RouteEnv, RouteState, asked_shelf, keeper_observation, route_problem, route_tasks

__all__ = ["SHELVES", "RouteEnv", "RouteState", "asked_shelf", "keeper_observation", "route_problem", "route_tasks"]
