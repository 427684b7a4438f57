"""Command-line entry points (the top layer: they may import any other part of marft)."""
