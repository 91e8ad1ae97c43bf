"""`eagle3-jax serve`: the engine behind OpenAI's HTTP API.

protocol: request bodies, their sampling parameters, response and error shapes. engine_loop: the
engine on its own thread, fed requests and aborts between iterations. metrics: Prometheus
collectors. app: the FastAPI routes. server: the command, uvicorn and signals.
"""
