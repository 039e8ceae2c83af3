"""Engine options from the command line (EngineArgs), sampling from the model's defaults plus any flags given."""

import argparse

from nanoengine import LLM, EngineArgs


def main(args: dict) -> None:
    overrides = {name: args.pop(name) for name in ("max_tokens", "temperature", "top_p", "top_k")}
    llm = LLM(**args)
    sampling_params = llm.get_default_sampling_params()
    for name, value in overrides.items():
        if value is not None:
            setattr(sampling_params, name, value)
    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
               "The future of AI is"]
    for output in llm.generate(prompts, sampling_params):
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser.add_argument_group("Engine arguments"))
    sampling = parser.add_argument_group("Sampling parameters")
    sampling.add_argument("--max-tokens", type=int)
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    main(vars(parser.parse_args()))
