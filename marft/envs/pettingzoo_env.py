"""Moved to :mod:`marft.envs.pettingzoo.env` (this path goes in the next release)."""
from marft.moved import alias

alias(__name__)
