"""pagecli: local LLM inference in the terminal with a paged KV cache."""

__version__ = "0.1.0"
