"""``relay_sum``: the cooperative toy task with a known optimum (:mod:`.env`)."""

from marft.envs.relay_sum.env import RelayState, RelaySumEnv

__all__ = ["RelayState", "RelaySumEnv"]
