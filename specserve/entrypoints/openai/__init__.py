"""An OpenAI-compatible HTTP server over the engine (``specserve serve``): request models
(``protocol``), the engine's thread and its asyncio front end (``engine_loop``), the FastAPI app
(``server``) and its Prometheus metrics (``metrics``)."""
