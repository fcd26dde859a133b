"""The package version (read by pyproject.toml and the tuning caches)."""

__version__ = "0.1.0"
