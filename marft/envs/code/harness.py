"""Moved to :mod:`marft.sandbox.harness`, split by concern (this path goes in the next release)."""
from marft.moved import alias

alias(__name__)
