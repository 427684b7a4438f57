"""Rollouts: the team plays its envs turn by turn (:mod:`.turns`) into a preallocated buffer (:mod:`.buffer`)."""
