"""The engine-core protocol's cost per message: encode + decode of a request and of one step's outputs, with the
msgpack codec (serve/codec.py) and with pickle (what the protocol used before).

    python benchmarks/codec.py [--running 128]

A step's outputs carry one DELTA output per running request (one new token each), as at the server's saturated
load (max_num_seqs=128 on the CPU); the request carries a 512-token prompt.
"""

import argparse
import pickle
import time
import timeit
import uuid

from nanoengine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
from nanoengine.sampling_params import RequestOutputKind, SamplingParams
from nanoengine.serve.codec import TO_CORE, TO_FRONT, Codec, EngineCoreOutputs, EngineCoreRequest


def step_outputs(running: int) -> EngineCoreOutputs:
    now = time.time()
    outputs = [RequestOutput(f"cmpl-{uuid.uuid4().hex}", None, [], [CompletionOutput(0, " word", [1234], None, None)],
                             False, RequestMetrics(now, now, now, now, None, 17)) for _ in range(running)]
    return EngineCoreOutputs(outputs, EngineStats(4096, 1024, 512, 10_000, 8_000, 0, running, 3))


def request() -> EngineCoreRequest:
    params = SamplingParams(temperature=0, max_tokens=128, output_kind=RequestOutputKind.DELTA)
    return EngineCoreRequest(f"cmpl-{uuid.uuid4().hex}", list(range(1000, 1512)), params, 0, time.time())


def microseconds(round_trip, number: int) -> float:
    return min(timeit.repeat(round_trip, number=number, repeat=5)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=128)
    args = parser.parse_args()
    front, core = Codec(TO_FRONT), Codec(TO_CORE)
    print("| message | bytes (msgpack / pickle) | msgpack µs | pickle µs |\n| --- | ---: | ---: | ---: |")
    for name, message, sender, receiver, number in [
            ("request (512-token prompt)", request(), front, core, 2000),
            (f"outputs of a step ({args.running} running)", step_outputs(args.running), core, front, 200),
            ("outputs of a step (8 running)", step_outputs(8), core, front, 2000)]:
        ours = microseconds(lambda m=message, s=sender, r=receiver: r.decode([s.encode(m)]), number)
        theirs = microseconds(lambda m=message: pickle.loads(pickle.dumps(m)), number)
        print(f"| {name} | {len(sender.encode(message)):,} / {len(pickle.dumps(message)):,} | {ours:.1f} | "
              f"{theirs:.1f} |")


if __name__ == "__main__":
    main()
