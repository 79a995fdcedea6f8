"""OpenAI-compatible HTTP server (``longflash serve``): FastAPI routes, a background engine loop,
Prometheus metrics with vLLM's names."""
