"""Moved to :mod:`marft.sandbox` (``runner`` and ``slots``; this path goes in the next release)."""
from marft.moved import alias

alias(__name__)
