"""/v1/responses driven by the openai client's ``client.responses``: the same tokens as the equivalent chat
request, the Responses events when streamed, function tools, and a 400 naming each field it does not serve."""

import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from benchmarks.serve import running_server
from nanoengine.serve.responses import ResponseWriter
from nanoengine.serve.tools import HermesCalls

MAX_MODEL_LEN = 256
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def server(sharp_tiny_model):
    with running_server(sharp_tiny_model[0], "--max-model-len", str(MAX_MODEL_LEN)) as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


def chat_text(client, messages, max_tokens=8) -> tuple[str, int]:
    reply = client.chat.completions.create(model=None, messages=messages, temperature=0, max_tokens=max_tokens)
    return reply.choices[0].message.content, reply.usage.prompt_tokens


def test_a_response_says_what_the_equivalent_chat_request_says(client):
    response = client.responses.create(model=None, input="Hi there",
                                       instructions="Answer briefly.", max_output_tokens=8, temperature=0,
                                       store=False)
    text, prompt_tokens = chat_text(client, [{"role": "system", "content": "Answer briefly."},
                                             {"role": "user", "content": "Hi there"}])
    assert response.output_text == text and response.usage.input_tokens == prompt_tokens
    assert (response.status, response.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert response.usage.output_tokens == 8 and response.id.startswith("resp_") and response.store is False
    [message] = response.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")


def test_message_items_become_the_conversation(client):
    items = [{"role": "developer", "content": "Be terse."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Count:"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "one", "annotations": []}]},
             {"role": "user", "content": "go on"}]
    response = client.responses.create(model=None, input=items, max_output_tokens=8, temperature=0)
    assert response.output_text == chat_text(client, [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "Count:"},
        {"role": "assistant", "content": "one"}, {"role": "user", "content": "go on"}])[0]


def test_a_streamed_response_sends_the_responses_events_in_order(client):
    kwargs = dict(model=None, input="Tell me", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-4].text == events[-1].response.output_text == whole.output_text


def test_text_format_json_schema_constrains_the_output(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    response = client.responses.create(model=None, input="Yes or no?", max_output_tokens=32, temperature=0, text={
        "format": {"type": "json_schema", "name": "answer", "schema": schema}})
    assert response.status == "completed" and response.incomplete_details is None
    jsonschema.validate(json.loads(response.output_text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_tool_is_called_with_valid_arguments(client, stream):
    kwargs = dict(model=None, input="Weather in Paris?", tools=[WEATHER], max_output_tokens=40, temperature=0,
                  tool_choice={"type": "function", "name": "get_weather"})
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert arguments == done.arguments and events[-1].type == "response.completed"
        response = events[-1].response
    else:
        response = client.responses.create(**kwargs)
    [call] = response.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert call.call_id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_a_function_call_round_trip_is_rendered_as_chat_history(client):
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "21 C, sunny"}]
    response = client.responses.create(model=None, input=items, tools=[WEATHER], tool_choice="none",
                                       max_output_tokens=8, temperature=0)
    text, prompt_tokens = chat_text(client, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"}])
    assert (response.output_text, response.usage.input_tokens) == (text, prompt_tokens)


REFUSED = [
    ({"store": True}, "store", "stores no responses"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "not supported"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "not supported"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"input": []}, "input", "at least 1"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type",
     "input_text"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"input": "word " * MAX_MODEL_LEN}, "input", "max_model_len"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "function"),
    ({"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"tools": [{**WEATHER, "strict": True}], "tool_choice": "none", "text": {"format": {"type": "json_schema"}}},
     "text.format.schema", "needs a schema"),
]


@pytest.mark.parametrize("fields, param, says", REFUSED)
def test_what_is_not_served_is_a_400_naming_the_field(server, client, fields, param, says):
    response = httpx.post(f"{server}/v1/responses", json={"input": "Hi", **fields}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert client.responses.create(model=None, input="Hi", max_output_tokens=2).usage.output_tokens == 2


def test_chat_tool_choice_auto_on_a_server_without_a_tool_call_parser_is_a_400_naming_the_flags(client):
    """(This module's server has no --tool-call-parser; tests/test_tools.py's has one.)"""
    with pytest.raises(BadRequestError, match="--enable-auto-tool-choice --tool-call-parser") as refused:
        client.chat.completions.create(model=None, messages=[{"role": "user", "content": "Hi"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    assert refused.value.body["param"] == "tool_choice"


def test_the_writer_closes_the_message_before_a_parsed_call_and_streams_what_it_returns_whole():
    text = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    writer = ResponseWriter({"output": []}, HermesCalls(parallel=True))
    events = writer.start()
    for i in range(0, len(text), 4):
        events += writer.write(text[i:i + 4], final=False)
    events += writer.write("", final=True) + writer.finish("stop", {})
    kinds = [e["type"] for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-8:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    message, call = events[-1]["response"]["output"]
    assert message["content"][0]["text"] == "Let me look." == "".join(
        e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == ("get_weather", {"city": "Paris"},
                                                                             "completed")
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1]
