"""The OpenAI-compatible server: ``nanoengine serve [MODEL] --port 8000`` (or ``python -m nanoengine.serve``).

A learner reads, in order: cli.py (start it), api_server.py (the routes), protocol.py (the bodies),
pipeline.py (body -> engine requests -> one transport), render.py and responses.py (the replies), tools.py
(tool calls), client.py (the front's handle on its cores), engine_core.py (the core's process), codec.py (the
messages between them). config.py, errors.py and metrics.py hold what their names say. cluster/ is what an
operator needs beyond one core (routing, restarts, the cluster key, admission and OS limits): skip it first.
"""
