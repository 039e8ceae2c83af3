"""The OpenAI-compatible server: an HTTP front process and an engine-core process, joined by ZMQ.

    nanoengine serve [MODEL] --port 8000     (or: python -m nanoengine.serve ...)

cli.py starts it, api_server.py holds the routes, client.py the front's side of the transport,
engine_core.py the engine's process, protocol.py the request bodies, metrics.py /metrics.
"""
