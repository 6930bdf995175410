"""Agent mode: your agent's code, over an OpenAI-compatible API, trained on its exact tokens.

Three rooms: ``openai`` (the wire format only: requests in, completions and error bodies out),
``sessions`` (the actor's driver: sessions as episodes, permits, the engine; domain errors, no
HTTP) and ``server`` (HTTP: routes, bodies, one table from errors to status codes). ``calls`` is
what the server hands the driver.
"""
