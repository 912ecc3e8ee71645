"""`hybrid-engine serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) on an EngineLoop."""
