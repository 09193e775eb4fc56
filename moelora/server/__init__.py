"""The HTTP server: OpenAI-compatible API, adapter management and metrics over one Engine. Needs the
`server` extra (fastapi, uvicorn, pydantic, prometheus-client); the engine does not import it."""
