"""Moved to :mod:`marft.runner.shared` (runner, checkpoint, best, preemption, storage, diagnostics); the old module
paths still import, with a ``DeprecationWarning``, until the next release."""
