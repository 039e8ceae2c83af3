"""Send the same long request twice and compare the time to first token; then break the reuse on purpose.

    python examples/prefix_caching_ttft.py [--model DIR]

Runs three requests offline (``LLM.generate``), then the same three through a ``nanoengine serve`` it starts,
with the ``openai`` client. The second request finds the shared prefix in the prefix cache, so only its last
block is computed. The third puts a per-request value (a request id) *before* the shared part: block 0
differs, so every block after it differs too, and nothing is reused.
"""

import argparse
import socket
import subprocess
import sys
import time

import httpx
from openai import OpenAI

from nanoengine import LLM, SamplingParams
from nanoengine.utils.default_model import default_model_path

SHARED = "You are the help desk of a library. " + " ".join(
    f"Rule {i}: books of shelf {i} may be borrowed for {i % 4 + 1} weeks." for i in range(1, 25))
QUESTION = "\nQuestion: how long may I borrow a book of shelf 7?\nAnswer:"
PROMPTS = {"first": SHARED + QUESTION, "same again": SHARED + QUESTION,
           "id first": "Request id 4711.\n" + SHARED + QUESTION}


def offline(model: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=8)
    with LLM(model) as llm:
        llm.generate("warm-up", params, use_tqdm=False)  # the first step also pays for one-time setup
        for name, prompt in PROMPTS.items():
            out = llm.generate(prompt, params, use_tqdm=False)[0]
            show("offline", name, out.metrics.time_to_first_token, out.num_cached_tokens, len(out.prompt_token_ids))


def served(model: str) -> None:
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "nanoengine.serve", model, "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # its log would interleave
    try:
        url = f"http://127.0.0.1:{port}"
        while not healthy(url):
            if server.poll() is not None:
                raise SystemExit(f"the server exited with code {server.returncode}")
            time.sleep(0.5)
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        client.completions.create(model=None, prompt="warm-up", max_tokens=1)
        for name, prompt in PROMPTS.items():
            start, first_token, usage = time.perf_counter(), None, None
            for chunk in client.completions.create(model=None, prompt=prompt, max_tokens=8, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}):
                first_token = first_token or (time.perf_counter() if chunk.choices else None)
                usage = chunk.usage or usage
            show("server", name, first_token - start, usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens)
    finally:
        server.terminate()
        server.wait()


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


def show(where: str, name: str, ttft_s: float, cached: int, prompt_tokens: int) -> None:
    print(f"{where:8} {name:11} TTFT {1000 * ttft_s:7.1f} ms   cached {cached:4} of {prompt_tokens} prompt tokens",
          flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    model = parser.parse_args().model or default_model_path()
    offline(model)
    served(model)
