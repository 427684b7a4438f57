"""The agent team on one base model."""
