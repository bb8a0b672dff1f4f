"""The release, one declaration: the package exports it, the server reports it."""

__version__ = "0.1.0"
