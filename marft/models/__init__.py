"""Models the project builds itself."""
