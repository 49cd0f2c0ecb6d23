"""The package version, in one place (the package face, the CLI and the HTML footer read it)."""

__version__ = "0.1.0"
