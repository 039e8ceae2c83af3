"""bench.py's vLLM peer: runs one workload through vLLM's ``LLM.generate`` in vLLM's own interpreter.

    .venv-vllm/bin/python scripts/bench_vllm_peer.py < workload.json

The workload (JSON on stdin): model, dtype, max_model_len, prompts (token ids), max_tokens (one per
prompt), temperature, batches (sizes that cut the prompts into consecutive runs) and speculative_config
(or null). The result is one line on stdout, ``RESULT_PREFIX`` and then a JSON list, per batch
(output_tokens, seconds: one ``generate`` call timed after a warm-up, as bench.py times ours); vLLM logs
to stdout as well, also after it. The same figures go to stderr for a person reading the log.
"""

import json
import sys
import time

from vllm import LLM, SamplingParams, TokensPrompt

RESULT_PREFIX = "bench_vllm_peer result: "  # bench.py looks for this line


def main() -> None:
    work = json.load(sys.stdin)
    llm = LLM(work["model"], dtype=work["dtype"], max_model_len=work["max_model_len"], seed=0,
              speculative_config=work["speculative_config"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in work["prompts"]]
    params = [SamplingParams(temperature=work["temperature"], max_tokens=n, ignore_eos=True)
              for n in work["max_tokens"]]
    llm.generate(prompts[:1], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    results, first = [], 0
    for size in work["batches"]:
        start = time.perf_counter()
        outputs = llm.generate(prompts[first:first + size], params[first:first + size], use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        results.append({"output_tokens": tokens, "seconds": seconds})
        print(f"bench_vllm_peer: vLLM {work['dtype']}, {size} at once: {tokens} tokens in {seconds:.2f} s",
              file=sys.stderr, flush=True)
        first += size
    print(RESULT_PREFIX + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
