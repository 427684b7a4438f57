"""Moved to :mod:`marft.runner.shared.best` (this path goes in the next release)."""
from marft.moved import alias

alias(__name__)
