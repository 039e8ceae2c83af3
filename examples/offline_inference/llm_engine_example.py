"""Drive LLMEngine by hand: build it from EngineArgs, add a request per step, print each one as it finishes."""

import argparse

from nanoengine import EngineArgs, LLMEngine, RequestOutput, SamplingParams


def create_test_prompts() -> list[tuple[str, SamplingParams]]:
    return [
        ("A robot may not injure a human being", SamplingParams(temperature=0.0, logprobs=1)),
        ("To be or not to be,", SamplingParams(temperature=0.8, top_k=5)),
        ("What is the meaning of life?", SamplingParams(n=2, temperature=0.8, top_p=0.95)),
    ]


def process_requests(engine: LLMEngine, test_prompts: list[tuple[str, SamplingParams]]) -> None:
    request_id = 0
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
        request_outputs: list[RequestOutput] = engine.step()
        for request_output in request_outputs:
            if request_output.finished:
                print(request_output)


def main(args: argparse.Namespace) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    process_requests(engine, create_test_prompts())


if __name__ == "__main__":
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser(description="Using the LLMEngine class directly"))
    main(parser.parse_args())
