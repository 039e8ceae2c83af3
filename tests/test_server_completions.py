"""What lm-eval, best-of-n and biased sampling send, through a real server and the official openai client
(httpx where the raw HTTP matters), against the offline engine: echo, max_tokens=0, batched prompts, n > 1,
logit_bias, text_offset, continuous usage, /tokenize and friends; and the fields refused with a 400."""

import json
from pathlib import Path

import httpx
import pytest
from openai import BadRequestError, OpenAI

from benchmarks.serve import running_server
from nanoengine import LLM, SamplingParams

MAX_MODEL_LEN = 256
PROMPTS = ["The cat sat on", "Once upon a time, in a land far"]


@pytest.fixture(scope="module")
def server(sharp_tiny_model, tmp_path_factory):
    """(url, log file) of a server on the sharp tiny model."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with log.open("w") as log_file, running_server(sharp_tiny_model[0], "--max-model-len", str(MAX_MODEL_LEN),
                                                   log=log_file) as (_, url):
        yield url, log


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server[0]}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline(sharp_tiny_model, one_torch_thread):
    with LLM(sharp_tiny_model[0], max_model_len=MAX_MODEL_LEN) as llm:
        yield llm


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


GREEDY = dict(model=None, temperature=0, extra_body={"ignore_eos": True})


def streamed_choices(chunks) -> dict[int, dict]:
    """Per choice index: the text and the logprobs lists of a completions stream, joined."""
    joined = {}
    for chunk in chunks:
        for choice in chunk.choices:
            into = joined.setdefault(choice.index, {"text": "", "tokens": [], "token_logprobs": [],
                                                    "text_offset": [], "finish_reason": None})
            into["text"] += choice.text
            into["finish_reason"] = choice.finish_reason or into["finish_reason"]
            if choice.logprobs is not None:
                for name in ("tokens", "token_logprobs", "text_offset"):
                    into[name] += getattr(choice.logprobs, name)
    return joined


@pytest.mark.parametrize("max_tokens", [3, 0])
def test_echo_returns_the_prompt_and_its_logprobs_then_the_output(client, offline, max_tokens):
    """lm-eval's request: echo, logprobs=1, max_tokens 1 (here 3) or 0 (the prompt alone)."""
    prompt = PROMPTS[1]
    [reference] = offline.generate([prompt], greedy(max_tokens, prompt_logprobs=1, logprobs=1), use_tqdm=False)
    reply = client.completions.create(prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens, **GREEDY)
    choice = reply.choices[0]
    assert choice.text == prompt + reference.outputs[0].text and choice.finish_reason == "length"
    logprobs = choice.logprobs
    token_ids = reference.prompt_token_ids + reference.outputs[0].token_ids
    entries = reference.prompt_logprobs + reference.outputs[0].logprobs
    assert len(logprobs.tokens) == len(token_ids) == len(reply.choices[0].logprobs.top_logprobs)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for got, top, token_id, entry in zip(logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], token_ids[1:],
                                         entries[1:]):
        assert got == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert max(top.values()) == pytest.approx(max(lp.logprob for lp in entry.values()), abs=1e-4)
        assert got in top.values()  # the chosen token is always among the top ones, as OpenAI gives them
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]
    assert "".join(logprobs.tokens) == choice.text
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(reference.prompt_token_ids),
                                                                          max_tokens)
    chunks = list(client.completions.create(prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens,
                                            stream=True, **GREEDY))
    [streamed] = streamed_choices(chunks).values()
    assert streamed["text"] == choice.text and streamed["text_offset"] == logprobs.text_offset
    assert streamed["token_logprobs"] == logprobs.token_logprobs and streamed["finish_reason"] == "length"


def test_a_list_of_prompts_gives_one_choice_each_in_order(client, offline):
    token_prompts = [list(range(300, 310)), list(range(500, 507))]
    for prompts in (PROMPTS, token_prompts):
        references = offline.generate(prompts, greedy(6), use_tqdm=False)
        reply = client.completions.create(prompt=prompts, max_tokens=6, **GREEDY)
        assert [c.index for c in reply.choices] == [0, 1]
        assert [c.text for c in reply.choices] == [r.outputs[0].text for r in references]
        assert reply.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in references)
        assert reply.usage.completion_tokens == 12
        streamed = streamed_choices(client.completions.create(prompt=prompts, max_tokens=6, stream=True, **GREEDY))
        assert {i: c["text"] for i, c in streamed.items()} == {0: reply.choices[0].text, 1: reply.choices[1].text}


def test_n_samples_per_prompt_prompt_major_as_the_offline_engine_seeds_them(client, offline):
    """Sample i of a prompt is seeded with seed + i; choice index = prompt index * n + i (OpenAI's order)."""
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=5, ignore_eos=True)
    references = offline.generate(PROMPTS, params, use_tqdm=False)
    expected = [o.text for r in references for o in r.outputs]
    assert len(set(expected)) == 4  # the samples differ, so a wrong order shows
    sampling = dict(model=None, temperature=1.0, seed=11, max_tokens=5, n=2, extra_body={"ignore_eos": True})
    reply = client.completions.create(prompt=PROMPTS, **sampling)
    assert [c.text for c in reply.choices] == expected and [c.index for c in reply.choices] == [0, 1, 2, 3]
    streamed = streamed_choices(client.completions.create(prompt=PROMPTS, stream=True, **sampling))
    assert [streamed[i]["text"] for i in range(4)] == expected
    best_of = client.completions.create(prompt=PROMPTS[0], best_of=2, **sampling)
    assert [c.text for c in best_of.choices] == expected[:2]


def test_n_chat_completions_streamed_and_not(client, offline):
    messages = [{"role": "user", "content": "Tell me about cats"}]
    [reference] = offline.chat(messages, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True),
                               use_tqdm=False)
    sampling = dict(model=None, messages=messages, n=3, temperature=1.0, seed=5, max_tokens=6,
                    extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**sampling)
    assert [c.message.content for c in reply.choices] == [o.text for o in reference.outputs]
    assert [c.index for c in reply.choices] == [0, 1, 2] and reply.usage.completion_tokens == 18
    texts, roles = {}, {}
    for chunk in client.chat.completions.create(stream=True, **sampling):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            roles[choice.index] = roles.get(choice.index) or choice.delta.role
    assert texts == {i: c.message.content for i, c in enumerate(reply.choices)}
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}


def test_logit_bias_changes_what_is_sampled_as_offline(client, offline):
    bias = {"1234": 100, "4321": 60.5}
    [reference] = offline.generate([PROMPTS[0]], greedy(5, logit_bias={1234: 100, 4321: 60.5}), use_tqdm=False)
    assert reference.outputs[0].token_ids == [1234] * 5
    reply = client.completions.create(prompt=PROMPTS[0], max_tokens=5, logit_bias=bias, **GREEDY)
    assert reply.choices[0].text == reference.outputs[0].text
    chat = [{"role": "user", "content": "Hi"}]
    [chat_reference] = offline.chat(chat, greedy(4, logit_bias={4321: 100}), use_tqdm=False)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=chat, max_tokens=4, logit_bias={"4321": 100}, stream=True, **GREEDY))
    assert streamed == chat_reference.outputs[0].text == offline.llm_engine.tokenizer.decode([4321] * 4)


def test_continuous_usage_stats_count_each_chunk(client):
    chunks = list(client.completions.create(prompt=PROMPTS[0], max_tokens=5, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == list(range(1, 6)) and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)


def test_prompt_logprobs_come_in_vllm_shape(server, offline):
    [reference] = offline.generate([PROMPTS[0]], greedy(2, prompt_logprobs=2), use_tqdm=False)
    reply = httpx.post(f"{server[0]}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0,
                                                            "prompt_logprobs": 2}).json()
    served = reply["choices"][0]["prompt_logprobs"]
    assert served[0] is None and len(served) == len(reference.prompt_token_ids)
    for entry, expected in zip(served[1:], reference.prompt_logprobs[1:]):
        assert {int(t): (e["rank"], e["decoded_token"]) for t, e in entry.items()} == {
            t: (lp.rank, lp.decoded_token) for t, lp in expected.items()}


def test_tokenize_detokenize_and_version(server, offline):
    url, tokenizer = server[0], offline.llm_engine.tokenizer
    reply = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert reply == {"count": len(tokenizer.encode("Hello world")), "max_model_len": MAX_MODEL_LEN,
                     "tokens": tokenizer.encode("Hello world"),
                     "token_strs": tokenizer.convert_ids_to_tokens(tokenizer.encode("Hello world"))}
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == offline.llm_engine.processor.render_chat(messages, add_generation_prompt=True)[1]
    assert httpx.post(f"{url}/detokenize", json={"tokens": chat["tokens"]}).json() == {
        "prompt": tokenizer.decode(chat["tokens"])}
    assert httpx.get(f"{url}/version").json()["version"]


BAD_REQUESTS = [
    ("completions", {"logit_bias": {"49152": 1}}, "logit_bias", "vocabulary"),
    ("completions", {"logit_bias": {"-3": 1}}, "logit_bias", "vocabulary"),
    ("completions", {"logit_bias": {"7": "Infinity"}}, "logit_bias", "finite"),  # sent as a bare Infinity
    ("completions", {"logit_bias": {"7": "NaN"}}, "logit_bias", "finite"),
    ("completions", {"logit_bias": {"seven": 1}}, "logit_bias", "token ids"),
    ("chat/completions", {"logit_bias": {"49152": 1}}, "logit_bias", "vocabulary"),
    ("completions", {"suffix": "!"}, "suffix", "not currently supported"),
    ("completions", {"best_of": 3, "n": 2}, "best_of", "equal n"),
    ("completions", {"max_tokens": 0}, "max_tokens", "echo"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "not streamed"),
    ("completions", {"n": 10**6}, "n", "max_num_seqs"),
    ("completions", {"prompt": ["fine", ""]}, "prompt", "empty"),
    ("completions", {"prompt": [[5, 6], [10**9]]}, "prompt", "vocabulary"),
    ("completions", {"use_beam_search": True}, "use_beam_search", "beam search"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ("chat/completions", {"echo": True}, "echo", "completions"),
    ("chat/completions", {"max_tokens": 0}, "max_tokens", "at least 1"),
    ("chat/completions", {"store": True}, "store", "not stored"),
    ("chat/completions", {"n": 2, "allowed_token_ids": [1, 2]}, "allowed_token_ids", "not implemented"),
]


@pytest.mark.parametrize("route, fields, param, says", BAD_REQUESTS)
def test_bad_or_unimplemented_fields_get_a_400_naming_them_and_the_server_goes_on(server, client, route, fields,
                                                                                  param, says):
    body = {"prompt": "Hi"} if route == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    content = json.dumps(body | fields).replace('"Infinity"', "Infinity").replace('"NaN"', "NaN")
    response = httpx.post(f"{server[0]}/v1/{route}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"]
    assert client.completions.create(prompt="Still here?", max_tokens=2, **GREEDY).usage.completion_tokens == 2


def test_the_openai_client_gets_the_400_too(client):
    with pytest.raises(BadRequestError) as raised:
        client.completions.create(prompt="Hi", max_tokens=2, logit_bias={"99999": 5}, model=None)
    assert raised.value.body["param"] == "logit_bias"


def test_unknown_fields_are_served_and_logged_once_each(server, client):
    for _ in range(2):
        reply = client.completions.create(prompt="Hi", max_tokens=2, extra_body={"frobnicate": 1, "user": "me"},
                                          model=None)
        assert reply.usage.completion_tokens <= 2
    logged = Path(server[1]).read_text()
    assert logged.count("'frobnicate'") == 1 and "'user'" not in logged


def test_chat_template_options_reach_the_template(client, offline):
    """continue_final_message, chat_template_kwargs and documents, as LLM.chat renders them."""
    messages = [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "My colour is"}]
    [reference] = offline.chat(messages, greedy(4), add_generation_prompt=False, continue_final_message=True,
                               chat_template_kwargs={"unused_variable": 1}, use_tqdm=False)
    reply = client.chat.completions.create(messages=messages, max_tokens=4, model=None, temperature=0, extra_body={
        "ignore_eos": True, "add_generation_prompt": False, "continue_final_message": True,
        "chat_template_kwargs": {"unused_variable": 1}, "documents": [{"title": "t", "text": "x"}]})
    assert reply.choices[0].message.content == reference.outputs[0].text
    assert reply.usage.prompt_tokens == len(reference.prompt_token_ids)
    for extra, param in [({"continue_final_message": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs")]:
        with pytest.raises(BadRequestError) as raised:
            client.chat.completions.create(messages=messages, max_tokens=2, extra_body=extra, model=None)
        assert raised.value.body["param"] == param


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_metrics_count_n_samples_as_one_request(server, client):
    names = ["nanoengine:prompt_tokens_total", "nanoengine:generation_tokens_total",
             "nanoengine:time_to_first_token_seconds_count", "nanoengine:inter_token_latency_seconds_count"]
    before = [metric(server[0], name) for name in names]
    reply = client.completions.create(prompt=PROMPTS[0], n=3, max_tokens=4, seed=1, model=None,
                                      extra_body={"ignore_eos": True})
    after = [metric(server[0], name) for name in names]
    assert [a - b for a, b in zip(after, before)][:3] == [reply.usage.prompt_tokens, 12, 1]
    assert after[3] - before[3] <= 9  # at most 3 gaps a sample, never one between two samples
