"""`pagecli serve`: the HTTP side (one request path in request_path.py, a translation module per API: OpenAI's
Chat Completions and Responses, Anthropic's Messages, Ollama's; the web page and /v1/pool; errors, metrics),
driving one Engine that runs in its own thread (engine_thread.py)."""
