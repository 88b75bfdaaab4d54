"""`mlx-spec serve`: an OpenAI-compatible HTTP server over the engine (app.py), its request
checks and response objects (protocol.py) and its prompt cache across requests (sessions.py)."""
