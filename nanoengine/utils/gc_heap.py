"""Leave the objects a long-running process made at start-up out of every later garbage collection.

CPython's collection of its oldest generation walks every object the process tracks: with torch and transformers
loaded (and, in an engine core, the model), some hundred thousand objects for a stall of every running request
(docs/performance.md has the figures). Up to CPython 3.13 one comes after that generation has grown by a quarter: in the
server's front, about every 500 requests. Frozen after start-up, those objects are never walked again (the same
collection then takes a fraction of the time), as vLLM does in its engine core and API server. Only in the processes
nanoengine owns (the server's front and engine cores, tensor-parallel workers), whose start-up objects live as
long as the process: in a user's process, an object frozen while alive would never be collected once it became
cyclic garbage.
"""

import gc


def freeze_startup_heap() -> None:
    gc.collect()  # the start-up's own garbage is freed, not frozen
    gc.freeze()
