"""ninfer: a Python serving system for the Qwen3.6 model family."""

__version__ = "0.1.0"
