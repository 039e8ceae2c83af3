"""Sample four prompts with temperature 0.8 and top-p 0.95 through LLM.generate."""

import sys

from nanoengine import LLM, SamplingParams

prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main(model: str) -> None:
    llm = LLM(model=model)
    for output in llm.generate(prompts, sampling_params):
        print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")


if __name__ == "__main__":
    main(sys.argv[1])
