"""`pagecli serve`: the OpenAI-compatible HTTP side (routes, SSE, errors, metrics), driving one Engine
that runs in its own thread (engine_thread.py)."""
