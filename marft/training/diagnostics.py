"""Moved to :mod:`marft.runner.shared.diagnostics` (this path goes in the next release)."""
from marft.moved import alias

alias(__name__)
