"""Perplexity over a fixed public-domain text, scored the way llama.cpp's ``llama-perplexity`` scores it.

The text (tests/fixtures/alice_chapters_1_2.txt, its source in tests/fixtures/README.md) is tokenized whole,
then cut into consecutive windows of ``n_ctx`` tokens (a last partial window is dropped). Each window is one
prompt of its own, with nothing cached from the window before; within it only the second half is scored:
positions ``n_ctx // 2 + 1`` to ``n_ctx - 1``, each given all the window's tokens before it, so every scored
token sees at least half a window of context. Where the tokenizer adds a BOS token, it replaces each window's
first token, as llama-perplexity does. Perplexity is exp of the mean negative log-likelihood of the scored
tokens; ours comes from the engine's ``prompt_logprobs``.
"""

import math
from pathlib import Path

from benchmarks.common import text_tokens
from nanoengine import LLM, SamplingParams

TEXT = Path(__file__).parent.parent / "tests" / "fixtures" / "alice_chapters_1_2.txt"
N_CTX = 1024  # 5 windows of the text, 2,555 scored tokens
GREEDY_PROMPTS, GREEDY_TOKENS, GREEDY_MAX_LEN = 16, 64, 512  # the spec preset's chat prompts, ~150 tokens each
QUANTIZED_PARTS = (("weights", "quantization"), ("KV", "kv_cache_dtype"))  # the engine's name: LLM's option
INT8_WEIGHTS, INT8_KV = {"quantization": "int8"}, {"kv_cache_dtype": "int8"}
QUALITY_RUNS = [("bfloat16", {}), ("float32", {}), ("bfloat16", INT8_WEIGHTS), ("bfloat16", INT8_KV),
                ("bfloat16", INT8_WEIGHTS | INT8_KV), ("bfloat16", {"quantization": "int4"})]


def window_starts(num_tokens: int, n_ctx: int) -> range:
    """Where each whole window of ``n_ctx`` tokens starts."""
    if num_tokens < 2 * n_ctx:
        raise ValueError(f"n_ctx={n_ctx} needs at least {2 * n_ctx} tokens (llama-perplexity's rule), "
                         f"the text has {num_tokens}")
    return range(0, num_tokens // n_ctx * n_ctx, n_ctx)


def scored_positions(n_ctx: int) -> range:
    """The positions in a window whose tokens are scored: the second half, less its first token (whose logits,
    at position n_ctx // 2 - 1, llama-perplexity does not ask for)."""
    return range(n_ctx // 2 + 1, n_ctx)


def windows(tokens: list[int], n_ctx: int, bos: int | None) -> list[list[int]]:
    cut = [tokens[start:start + n_ctx] for start in window_starts(len(tokens), n_ctx)]
    return [[bos] + window[1:] for window in cut] if bos is not None else cut


def engine_nlls(llm: LLM, tokens: list[int], n_ctx: int, bos: int | None = None) -> list[float]:
    """The negative log-likelihood of every scored token, window by window, through ``prompt_logprobs``."""
    prompts = windows(tokens, n_ctx, bos)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [-out.prompt_logprobs[pos][prompt[pos]].logprob
            for prompt, out in zip(prompts, outputs) for pos in scored_positions(n_ctx)]


def perplexity(nlls: list[float]) -> float:
    return math.exp(sum(nlls) / len(nlls))


def engine_perplexity(model: str, dtype: str, n_ctx: int = N_CTX, text: Path = TEXT, greedy_prompts=(),
                      **llm_options) -> dict:
    """Our perplexity on ``text``; with ``greedy_prompts`` (token ids), also the greedy tokens we answer them with."""
    max_model_len = max(n_ctx, GREEDY_MAX_LEN if greedy_prompts else 0) + 16
    with LLM(model, dtype=dtype, max_model_len=max_model_len, **llm_options) as llm:
        context = llm.config.hf_config.max_position_embeddings
        if n_ctx > context:
            raise ValueError(f"n_ctx={n_ctx} is longer than the model's context ({context})")
        tokens, bos = text_tokens(llm.get_tokenizer(), text.read_text())
        nlls = engine_nlls(llm, tokens, n_ctx, bos)
        params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
        answers = llm.generate(list(greedy_prompts), params, use_tqdm=False) if greedy_prompts else []
        greedy = [answer.outputs[0].token_ids for answer in answers]
    quantized = [f"{llm_options[option]} {part}" for part, option in QUANTIZED_PARTS if llm_options.get(option)]
    return {"engine": " + ".join([f"nanoengine {dtype}", *quantized]), "perplexity": perplexity(nlls),
            "scored_tokens": len(nlls), "text_tokens": len(tokens), "greedy": greedy}


def greedy_agreement(reference: list[list[int]], other: list[list[int]]) -> tuple[int, float]:
    """How many answers are identical, and the mean share of each answer before its first differing token."""
    prefixes = [next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), len(ref)) / len(ref)
                for ref, out in zip(reference, other)]
    return sum(p == 1 for p in prefixes), sum(prefixes) / len(prefixes)


def announced(run: dict, reference: list[list[int]]) -> dict:
    """Our ``run`` with how its greedy answers agree with ``reference``, printed as soon as it is scored."""
    run["identical_answers"], run["greedy_prefix"] = greedy_agreement(reference, run.pop("greedy"))
    print(f"bench: {run['engine']}: perplexity {run['perplexity']:.4f}", flush=True)
    return run


def quality_preset(args) -> dict:
    """Our perplexity in bfloat16 and float32, in bfloat16 with int8 weights, an int8 KV cache and both, and int4
    weights; llama.cpp's with each of its files (once `make llamacpp` has made them) and ours reading the same file,
    on the same text and windows; and how often ours answer the spec preset's chat prompts with bfloat16's greedy
    tokens."""
    from transformers import AutoTokenizer

    from benchmarks.common import model_for
    from benchmarks.llamacpp import llamacpp_perplexities
    from benchmarks.spec import grounded_prompts

    model = model_for(args)
    n_ctx = args.n_ctx or N_CTX
    chat = grounded_prompts(AutoTokenizer.from_pretrained(model), GREEDY_PROMPTS)
    runs = [engine_perplexity(model, dtype, n_ctx, greedy_prompts=chat, **options) for dtype, options in QUALITY_RUNS]
    reference = runs[0]["greedy"]
    runs = [announced(run, reference) for run in runs]
    peers, tokens_note = llamacpp_perplexities(model, n_ctx, TEXT)
    for gguf, peer in peers.items():  # each of llama.cpp's files read by us too, at bfloat16
        ours = engine_perplexity(str(gguf), "bfloat16", n_ctx, greedy_prompts=chat)
        ours["engine"] = peer["engine"].replace("llama.cpp", "nanoengine bfloat16")
        runs += [peer, announced(ours, reference)]
    return {"preset": "quality", "model": model, "text": TEXT.name, "n_ctx": n_ctx, "runs": runs,
            "tokens_note": tokens_note, "greedy_prompts": len(chat), "greedy_tokens": GREEDY_TOKENS}


def print_quality_table(report: dict) -> None:
    print(f"\nquality preset: perplexity of {report['model']} on {report['text']}, windows of {report['n_ctx']} "
          f"tokens, the second half of each scored")
    base = report["runs"][0]["perplexity"]
    print(f"{'engine':<46}{'perplexity':>12}{'vs ours bf16':>14}{'scored tokens':>15}{'same answers':>14}"
          f"{'same prefix':>13}")
    for run in report["runs"]:
        change = 100 * (run["perplexity"] / base - 1)
        agreement = (f"{run['identical_answers']:>9}/{report['greedy_prompts']:<4}{100 * run['greedy_prefix']:>12.1f}%"
                     if "identical_answers" in run else "")
        print(f"{run['engine']:<46}{run['perplexity']:>12.4f}{change:>+13.2f}%{run['scored_tokens']:>15,}{agreement}")
    print(f"same answers: of {report['greedy_prompts']} chat prompts, those answered with bfloat16's "
          f"{report['greedy_tokens']} greedy tokens; same prefix: the mean share before the first differing token")
    if report["tokens_note"]:
        print(report["tokens_note"])
