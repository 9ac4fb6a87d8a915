"""`topk serve`: an OpenAI-compatible HTTP server over one cache (Starlette + uvicorn)."""
