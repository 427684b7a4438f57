"""Runners: :mod:`marft.runner.shared`, the one runner every env trains with."""
