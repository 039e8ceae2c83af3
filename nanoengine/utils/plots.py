"""Plots (the ``plot`` extra, matplotlib): the step history of ``EngineStats.plot`` and bench.py, and the
prefix report's hit rate. Kept out of the engine: nothing on the serving path imports matplotlib."""


def new_figure(what: str, **options):
    """A matplotlib Figure (the ``plot`` extra), or an ImportError that says how to install it."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"plotting {what} needs matplotlib: pip install 'nanoengine[plot]'") from e
    return Figure(layout="constrained", **options)


def plot_step_history(history: list[tuple[int, int, float]], path: str) -> None:
    """Running and waiting requests and KV-cache usage after each step, as a PNG at ``path``."""
    fig = new_figure("the step history", figsize=(8, 5))
    from matplotlib.ticker import MaxNLocator
    steps = range(1, len(history) + 1)
    running, waiting, usage = zip(*history) if history else ((), (), ())
    queues, kv = fig.subplots(2, 1, sharex=True)
    queues.step(steps, running, where="post", label="running")
    queues.step(steps, waiting, where="post", label="waiting")
    queues.set_ylabel("requests")
    queues.yaxis.set_major_locator(MaxNLocator(integer=True))
    queues.legend()
    kv.step(steps, [100 * u for u in usage], where="post", color="tab:red")
    kv.set_ylabel("KV cache used (%)")
    kv.set_ylim(0, 100)
    kv.set_xlabel("step")
    fig.savefig(path, format="png")
