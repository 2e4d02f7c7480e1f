"""The package version (validation results are keyed by it)."""

__version__ = "2.0.0.dev0"
