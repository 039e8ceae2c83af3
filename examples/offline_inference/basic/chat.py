"""LLM.chat on one conversation, on a batch of them, and with a chat template read from a file."""

import argparse

from nanoengine import LLM, EngineArgs, SamplingParams

SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k")


def print_outputs(outputs) -> None:
    for output in outputs:
        print(f"Prompt: {output.prompt!r}")
        print(f"Generated text: {output.outputs[0].text!r}")
    print("-" * 80)


def main(args: argparse.Namespace) -> None:
    options = vars(args)
    chat_template_path = options.pop("chat_template_path")
    sampling_params = SamplingParams(**{name: options.pop(name) for name in SAMPLING_FLAGS})
    llm = LLM(**options)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    print_outputs(llm.chat(conversation, sampling_params, use_tqdm=False))
    conversations = [conversation] * 10
    print_outputs(llm.chat(conversations, sampling_params, use_tqdm=True))
    if chat_template_path:
        with open(chat_template_path) as f:
            chat_template = f.read()
        print_outputs(llm.chat(conversations, sampling_params, use_tqdm=False, chat_template=chat_template))


if __name__ == "__main__":
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1)
    parser.add_argument("--chat-template-path", type=str, default=None)
    main(parser.parse_args())
