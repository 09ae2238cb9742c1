"""The OpenAI-compatible server: ``async_engine`` (the engine loop on a thread, asyncio
outside), ``protocol`` (request/response shapes), ``openai_serving`` (requests -> engine
requests -> responses and SSE), ``app`` (FastAPI app, ``build_app`` for ``serve run``),
``deployment`` (the Ray Serve replica), ``settings`` (validated config), ``metrics``
(Prometheus text), ``errors`` (OpenAI error bodies).

Importing this package imports nothing heavy: ray is only imported by ``deployment``.
"""
