"""Moved to :mod:`marft.runner.shared` (buffer, collector, evaluation, turns); the old module paths still import,
with a ``DeprecationWarning``, until the next release."""
