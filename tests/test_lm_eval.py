"""lm-eval's ``local-completions`` against a real server, on a small multiple-choice task written here (no hub):
every loglikelihood the harness computes must be the offline engine's prompt_logprobs of the same tokens, so an
echo that came back empty (scored 0) or wrong fails."""

import json
from pathlib import Path

import lm_eval
import pytest
from lm_eval.models.openai_completions import LocalCompletionsAPI
from lm_eval.tasks import TaskManager

from benchmarks.serve import running_server
from nanoengine import LLM, SamplingParams

DOCS = [{"question": "The capital of France is", "choices": ["Paris", "Berlin", "a small town"], "answer": 0},
        {"question": "Two plus two equals", "choices": ["four", "five"], "answer": 0},
        {"question": "The sky is", "choices": ["blue", "green and yellow"], "answer": 0}]


def write_task(folder) -> str:
    (folder / "docs.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (folder / "task.yaml").write_text(f"""task: nanoengine_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / "docs.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    return "nanoengine_tiny_mc"


@pytest.fixture(scope="module")
def server_url(sharp_tiny_model):
    with running_server(sharp_tiny_model[0], "--max-model-len", "256") as (_, url):
        yield url


@pytest.mark.parametrize("tokenized", [True, False])
def test_the_harness_scores_what_the_engine_computes(sharp_tiny_model, server_url, tmp_path, monkeypatch,
                                                     tokenized):
    """Tokenized: batches of token-id lists (lm-eval's default); not: one string prompt per request."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    folder = sharp_tiny_model[0]
    task = write_task(tmp_path)
    lm = LocalCompletionsAPI(model=Path(folder).name, base_url=f"{server_url}/v1/completions", tokenizer=folder,
                             batch_size=2 if tokenized else 1, tokenized_requests=tokenized)
    results = lm_eval.simple_evaluate(model=lm, tasks=[task], log_samples=True,
                                      task_manager=TaskManager(include_path=str(tmp_path)))
    samples = results["samples"][task]
    pairs = [(args[0], args[1]) for sample in samples for args in sample["arguments"]]
    scored = [response[0] for sample in samples for response in sample["resps"]]
    assert len(pairs) == len(scored) == 7
    encoded = [lm._encode_pair(context, continuation) for context, continuation in pairs]
    with LLM(folder, max_model_len=256) as llm:
        outputs = llm.generate([context + continuation for context, continuation in encoded],
                               SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False)
    for (context, continuation), output, (loglikelihood, is_greedy) in zip(encoded, outputs, scored):
        entries = output.prompt_logprobs[len(context):]
        tokens = output.prompt_token_ids[len(context):]
        assert tokens == continuation
        assert loglikelihood == pytest.approx(sum(e[t].logprob for e, t in zip(entries, tokens)), abs=1e-3)
        assert loglikelihood < 0 and is_greedy == all(e[t].rank == 1 for e, t in zip(entries, tokens))
