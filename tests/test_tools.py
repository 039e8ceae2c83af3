"""Tool calling on /v1/chat/completions, driven by the openai client and LangChain against real servers: forced
calls (named, required) through structured outputs, "auto" through the hermes parser, the tool round trip."""

import json
import shutil
from types import SimpleNamespace
from typing import Literal

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from openai import OpenAI
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from benchmarks.serve import running_server
from nanoengine.config import EngineConfig
from nanoengine.engine.processor import Processor
from nanoengine.serve.errors import APIError
from nanoengine.serve.pipeline import OpenAIServer
from nanoengine.serve.protocol import ChatCompletionRequest, Tool
from nanoengine.serve.tools import HermesCalls, RequiredCalls, calls_schema, merged

MAX_MODEL_LEN = 1024  # room for several random schemas rendered into the prompt, and 400 tokens of calls

# A Qwen-like template (tools in the system turn, calls as <tool_call>...</tool_call>): SmolLM2's renders neither.
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these functions:
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
Write a call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}
{%- for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 23}},
                                       "required": ["hour"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def hermes_model(sharp_tiny_model, tmp_path_factory):
    folder = shutil.copytree(sharp_tiny_model[0], tmp_path_factory.mktemp("hermes") / "model")
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": MAX_MODEL_LEN}))
    return str(folder)


@pytest.fixture(scope="module")
def server(hermes_model):
    with running_server(hermes_model, "--max-model-len", str(MAX_MODEL_LEN), "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes") as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def chat(client, stream=False, **kwargs):
    """A reply's (content, tool calls as dicts, finish_reason), whole or gathered from its chunks."""
    kwargs = {"model": None, "messages": ASK, "temperature": 0, "max_tokens": 120, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [call.model_dump() for call in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, deltas, finish_reason = None, [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta
        if delta.content:
            content = (content or "") + delta.content
        deltas += [call.model_dump(exclude_none=True) for call in delta.tool_calls or []]
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    for delta in deltas:  # the first delta of a call has its id and name, the later ones only arguments
        assert ("id" in delta) == ("name" in delta["function"])
    return content, merged(deltas), finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_always_calls_that_function_with_valid_arguments(client, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish_reason = chat(client, stream, tools=[TIME, WEATHER], tool_choice=named)
    assert (content, finish_reason, len(calls)) == (None, "tool_calls", 1)
    assert calls[0]["id"].startswith("chatcmpl-tool-") and calls[0]["type"] == "function"
    assert calls[0]["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMAS["get_weather"])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_given_functions_with_valid_arguments(client, stream, parallel):
    content, calls, finish_reason = chat(client, stream, tools=[TIME, WEATHER], tool_choice="required",
                                         parallel_tool_calls=parallel)
    assert content is None and finish_reason == "tool_calls"
    assert len(calls) >= 1 if parallel else len(calls) == 1
    assert len({call["id"] for call in calls}) == len(calls)
    for call in calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


leaf_schemas = st.one_of(
    st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "boolean"}),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=4, unique=True).map(
        lambda words: {"enum": words}),
)


def objects(values):
    return st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), values, min_size=1, max_size=4).flatmap(
        lambda properties: st.builds(
            lambda required: {"type": "object", "properties": properties, "required": sorted(required)},
            st.sets(st.sampled_from(sorted(properties)))))


argument_schemas = objects(st.one_of(leaf_schemas, objects(leaf_schemas),
                                     leaf_schemas.map(lambda item: {"type": "array", "items": item, "maxItems": 3})))


@settings(max_examples=10, deadline=None, derandomize=True, database=None, phases=[Phase.generate],  # no shrinking:
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # each try is a request
@given(schemas=st.lists(argument_schemas, min_size=1, max_size=3), named=st.booleans(), parallel=st.booleans(),
       seed=st.integers(0, 99))
def test_forced_calls_for_random_schemas_always_have_valid_arguments(client, schemas, named, parallel, seed):
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": s}} for i, s in enumerate(schemas)]
    choice = {"type": "function", "function": {"name": "f0"}} if named else "required"
    _, calls, finish_reason = chat(client, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
                                   temperature=1.0, seed=seed, max_tokens=400)
    # "required" with parallel calls is an array without an end: a random model may go on calling until
    # max_tokens; the calls it completed are still whole and valid.
    assert calls and (finish_reason == "tool_calls" or not named and parallel and finish_reason == "length")
    for call in calls:
        # xgrammar's JSON strings admit raw control characters other than CR and LF (docs/api.md): read them as
        # LangChain does, strict=False; the schema check is the test.
        arguments = json.loads(call["function"]["arguments"], strict=False)
        jsonschema.validate(arguments, schemas[int(call["function"]["name"][1:])])


def weather_call_text(prefix: str) -> str:
    """A regex for exactly ``prefix`` then one hermes call: it makes the random model write a call."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    return "".join("\\" + c if c in "{}[]().*+?|\\" else c for c in prefix + call)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_hermes_calls_out_of_the_text(client, stream):
    forced = {"structured_outputs": {"regex": weather_call_text("Let me look. ")}}
    content, calls, finish_reason = chat(client, stream, tools=[WEATHER], extra_body=forced)
    assert (content, finish_reason) == ("Let me look.", "tool_calls")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    plain = {"structured_outputs": {"regex": "It is sunny <tool"}}
    assert chat(client, stream, tools=[WEATHER], extra_body=plain) == ("It is sunny <tool", [], "stop")


def test_tool_choice_none_renders_the_tools_and_parses_nothing(client):
    forced = {"structured_outputs": {"regex": weather_call_text("")}}
    content, calls, _ = chat(client, tools=[WEATHER], tool_choice="none", extra_body=forced)
    assert content.startswith("<tool_call>") and calls == []


HERMES_TEXT = ('Checking both. <tool_call>\n{"name": "a", "arguments": {"x": [1, "é"]}}\n</tool_call>\n'
               '<tool_call>{"name": "b"}</tool_call> <tool_call>not json</tool_call><tool_c')


def test_the_hermes_parser_streamed_in_any_pieces_says_what_it_says_whole():
    whole = HermesCalls(parallel=True).feed(HERMES_TEXT, final=True)
    assert whole[0] == "Checking both. \n <tool_call>not json</tool_call><tool_c"  # text outside the calls
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in merged(whole[1])] == [
        ("a", '{"x": [1, "é"]}'), ("b", "{}")]
    for size in (1, 2, 5, 11):
        parser = HermesCalls(parallel=True)
        pieces = [parser.feed(HERMES_TEXT[i:i + size], final=False) for i in range(0, len(HERMES_TEXT), size)]
        pieces.append(parser.feed("", final=True))
        assert "".join(content for content, _ in pieces) == whole[0]
        assert [d for _, deltas in pieces for d in deltas if "id" not in d] == [d for d in whole[1] if "id" not in d]
    assert len(merged(HermesCalls(parallel=False).feed(HERMES_TEXT, final=True)[1])) == 1


def test_required_calls_are_sent_as_each_completes():
    parser = RequiredCalls()
    text = '[{"name": "a", "parameters": {"k": {"n": 1}}}, {"name": "b", "parameters": {}}]'
    first_end = text.index("}}}") + 3
    assert parser.feed(text[:first_end - 1], final=False)[1] == []
    _, deltas = parser.feed(text[first_end - 1:first_end], final=False)
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in merged(deltas)] == [("a", '{"k": {"n": 1}}')]
    assert [d["index"] for d in parser.feed(text[first_end:], final=True)[1]] == [1, 1]


def test_the_required_schema_takes_each_tools_calls_and_lifts_their_defs():
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tools = [Tool.model_validate({"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"],
        "$defs": {"point": point}}}}), Tool.model_validate({"type": "function", "function": {"name": "stop"}})]
    schema = calls_schema(tools, parallel=False)
    jsonschema.validate([{"name": "move", "parameters": {"to": {"x": 1}}}], schema)
    jsonschema.validate([{"name": "stop", "parameters": {}}], schema)
    for bad in ([], [{"name": "move", "parameters": {"to": {}}}], [{"name": "fly", "parameters": {}}],
                [{"name": "stop", "parameters": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_a_three_turn_tool_round_trip_renders_the_history(client, hermes_model):
    tokenizer = AutoTokenizer.from_pretrained(hermes_model)
    named = {"type": "function", "function": {"name": "get_weather"}}
    messages = list(ASK)
    for turn in range(3):
        reply = client.chat.completions.create(model=None, messages=messages, tools=[WEATHER], temperature=0,
                                               max_tokens=40, tool_choice=named if turn != 1 else "none")
        rendered = [{**m, "content": m.get("content") or "", "tool_calls": [
            {**c, "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in m.get("tool_calls") or []]} for m in messages]
        prompt = tokenizer.apply_chat_template(rendered, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
        assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
        message = reply.choices[0].message
        if turn == 1:
            assert message.content and not message.tool_calls
            messages += [{"role": "assistant", "content": message.content},
                         {"role": "user", "content": "And in Rome?"}]
        else:
            call = message.tool_calls[0]
            assert message.content is None and call.function.name == "get_weather"
            messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    assert '{"temperature": 21}' in prompt and prompt.count("<tool_call>") == 2


BAD_TOOL_REQUESTS = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice", "fly"),
    ({"tools": [{"type": "function"}]}, "tools.0.function", "required"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name", "at least 1"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "tools.0.function.strict",
     "not enforced"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools", "compiled"),
    ({"messages": [{"role": "user"}]}, "messages.0.content", "only an assistant"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": "{oops"}}]}]},
     "messages.1.tool_calls.0.function.arguments", "JSON"),
]


@pytest.mark.parametrize("body, param, says", BAD_TOOL_REQUESTS)
def test_bad_tool_requests_get_400_naming_the_field_and_leave_the_server_serving(client, server, body, param, says):
    response = httpx.post(f"{server}/v1/chat/completions", json={"messages": ASK, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert chat(client, max_tokens=3)[2] == "length"


def test_auto_with_a_template_that_does_not_render_tools_is_a_400(sharp_tiny_model, hermes_model):
    """SmolLM2's template drops tools: under "auto" the model would never see them. A named call needs no
    template: its grammar holds the function's schema."""
    def prompt(folder, tool_choice):
        front = OpenAIServer(SimpleNamespace(unavailable=None), Processor(EngineConfig(folder)), ["m"], None, "hermes")
        body = ChatCompletionRequest(messages=ASK, tools=[WEATHER], tool_choice=tool_choice)
        return front.prepare(body).requests[0].prompt_token_ids

    with pytest.raises(APIError, match="does not render tools") as refused:
        prompt(sharp_tiny_model[0], "auto")
    assert refused.value.param == "tools"
    assert prompt(sharp_tiny_model[0], "required") and prompt(hermes_model, "auto")


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=12)
    unit: Literal["celsius", "fahrenheit"]


def test_langchain_bind_tools_round_trip_and_structured_output(client, server):
    llm = ChatOpenAI(base_url=f"{server}/v1", api_key="none", model=client.models.list().data[0].id, temperature=0,
                     max_tokens=60, max_retries=0)
    question = HumanMessage("What is the weather in Paris?")
    call_message = llm.bind_tools([Weather], tool_choice="Weather").invoke([question])
    [call] = call_message.tool_calls
    assert call["name"] == "Weather" and Weather.model_validate(call["args"])
    streamed = sum(llm.bind_tools([Weather], tool_choice="Weather").stream([question]), start=AIMessageChunk(""))
    assert [c["args"] for c in streamed.tool_calls] == [call["args"]]
    answer = llm.bind_tools([Weather], tool_choice="none").invoke(
        [question, call_message, ToolMessage('{"temperature": 21}', tool_call_id=call["id"])])
    assert answer.content and not answer.tool_calls
    assert isinstance(llm.with_structured_output(Weather, method="function_calling").invoke([question]), Weather)
