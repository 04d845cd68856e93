"""The package version: one home, read by setuptools and stamped into plans."""

__version__ = "0.1.0"
