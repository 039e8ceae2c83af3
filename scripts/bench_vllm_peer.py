"""bench.py's vLLM peer: runs one workload through vLLM's ``LLM.generate`` in vLLM's own interpreter.

    .venv-vllm/bin/python scripts/bench_vllm_peer.py < workload.json

The workload (JSON on stdin): model, dtype, max_model_len, prompts (token ids), max_tokens (one per
prompt), temperature. The last line on stdout is the result as JSON: output_tokens and seconds, timed
around one ``generate`` call after a warm-up, as bench.py times ours.
"""

import json
import sys
import time

from vllm import LLM, SamplingParams, TokensPrompt


def main() -> None:
    work = json.load(sys.stdin)
    llm = LLM(work["model"], dtype=work["dtype"], max_model_len=work["max_model_len"], seed=0)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in work["prompts"]]
    params = [SamplingParams(temperature=work["temperature"], max_tokens=n, ignore_eos=True)
              for n in work["max_tokens"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    print(json.dumps({"output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs), "seconds": seconds}))


if __name__ == "__main__":
    main()
