"""The HTTP server: an OpenAI-compatible API, its metrics and the live pipeline page, over one head."""
