"""verispec's version, written once: the package's __version__, `verispec --version` and pyproject.toml (dynamic) read it."""

__version__ = "0.2.0"
