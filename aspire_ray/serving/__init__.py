"""The OpenAI-compatible server: ``async_engine`` (the engine loop on a thread, asyncio
outside), ``protocol`` (request/response shapes), ``openai_serving`` (requests -> engine
requests -> responses and SSE), ``app`` (the FastAPI app), ``deployment`` (the Ray Serve
replica and ``build_app`` for ``serve run``), ``settings`` (validated config), ``metrics``
(Prometheus), ``errors`` (OpenAI error bodies).

Importing this package imports nothing heavy: ray is only imported by ``deployment``.
"""
