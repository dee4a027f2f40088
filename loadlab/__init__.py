"""loadlab: load testing for SGLang servers with per-token timing."""

__version__ = "0.1.0"
