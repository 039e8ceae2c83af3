"""Structured outputs on the real SmolLM2: every output matches its grammar, under every engine path."""

import ast
import json
import re

import jsonschema
import pytest
import torch
from conftest import keep_every_draft
from transformers import AutoModelForCausalLM

from nanoengine import LLM, RequestOutputKind, SamplingParams
from nanoengine import StructuredOutputsParams as Structured
from nanoengine.engine.structured_output import grammar_prefix

# Strings are bounded by a pattern: xgrammar 0.2.9 turns maxLength into a character class that admits raw
# control characters, which strict JSON forbids (its issue #800).
NAME = {"type": "string", "pattern": "^[A-Za-z ]{1,12}$"}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}
COLOR = {"enum": ["red", "green", "blue"]}
TAGS = {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "minItems": 1, "maxItems": 3}
POINT = {"type": "object", "properties": {"x": AGE, "y": AGE}, "required": ["x", "y"]}


def obj(required: dict, optional: dict | None = None) -> dict:
    return {"type": "object", "properties": {**required, **(optional or {})}, "required": list(required)}


# Sixteen different schemas: nested objects, arrays, enums, bounded integers, required and optional fields.
SCHEMAS = [
    obj({"name": NAME, "age": AGE}),
    obj({"color": COLOR}),
    obj({"tags": TAGS}),
    obj({"point": POINT}),
    obj({"name": NAME}, {"age": AGE}),
    obj({"people": {"type": "array", "items": obj({"name": NAME}), "minItems": 1, "maxItems": 2}}),
    obj({"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 1, "maximum": 9}}),
    obj({"city": NAME, "country": NAME, "population": AGE}),
    obj({"shape": {"enum": ["circle", "square"]}, "size": AGE}),
    obj({"owner": obj({"name": NAME, "pet": obj({"kind": COLOR})})}),
    obj({"scores": {"type": "array", "items": AGE, "minItems": 2, "maxItems": 4}}),
    obj({"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}}),
    obj({"start": POINT, "end": POINT}),
    obj({"answer": {"enum": ["yes", "no", "maybe"]}, "why": NAME}),
    obj({"id": {"type": "integer", "minimum": 100, "maximum": 999}, "tags": TAGS}),
    obj({"nothing": {"type": "null"}, "name": NAME}),
]
REGEXES = {"date": r"\d{4}-\d{2}-\d{2}", "phone": r"\(\d{3}\) \d{3}-\d{4}"}
CHOICES = ["Paris", "London", "Rome", "Berlin"]
ARITHMETIC = '''root ::= term (op term){0,3}
op ::= " + " | " - " | " * "
term ::= [1-9] [0-9]? | "(" [1-9] op [1-9] ")"'''
NEIGHBOURS = ["The capital of France is", "Once upon a time"]


def check_json(schema: dict):
    return lambda text: jsonschema.validate(json.loads(text), schema)


def check_object(text: str) -> None:
    assert isinstance(json.loads(text), dict)


def check_regex(pattern: str):
    return lambda text: re.fullmatch(pattern, text) or pytest.fail(f"{text!r} does not match {pattern!r}")


def check_choice(text: str) -> None:
    assert text in CHOICES


def check_arithmetic(text: str) -> None:
    tree = ast.parse(text, mode="eval")
    assert all(isinstance(node, ast.expr | ast.operator) for node in ast.walk(tree.body)), text


def structured_cases() -> list[tuple[str, Structured, object]]:
    """(prompt, constraint, checker) for every kind of constraint; the first ones bound the output's length."""
    # Compact JSON: sampling at T=0.8, a 135M model can otherwise spend every token on optional newlines.
    cases = [(f"Describe example {i} as JSON:", Structured(json=schema, disable_any_whitespace=True),
               check_json(schema)) for i, schema in enumerate(SCHEMAS)]
    cases += [(f"Write a {kind}:", Structured(regex=pattern), check_regex(pattern))
              for kind, pattern in REGEXES.items()]
    cases += [("The capital of Italy is", Structured(choice=CHOICES), check_choice),
              ("Write a sum:", Structured(grammar=ARITHMETIC), check_arithmetic)]
    # Unbounded: any JSON object may go on past max_tokens when sampled, so these run greedy only.
    cases += [("Give me a JSON object:", Structured(json_object=True), check_object),
              ("Describe a person as JSON:", Structured(json=json.dumps(SCHEMAS[0])), check_json(SCHEMAS[0]))]
    return cases


def params(constraint: Structured | None, seed: int | None = None) -> SamplingParams:
    temperature = 0 if seed is None else 0.8
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=96, structured_outputs=constraint)


def run_mixed_batch(llm: LLM, only_bounded: bool = False) -> dict:
    """Every structured case greedy, the bounded ones seeded too, beside unconstrained neighbours, in one batch."""
    cases = structured_cases()
    bounded = cases[:-2]
    cases = bounded if only_bounded else cases
    prompts = [p for p, _, _ in cases + bounded] + NEIGHBOURS
    sampling = ([params(c) for _, c, _ in cases] + [params(c, seed=i) for i, (_, c, _) in enumerate(bounded)]
                + [params(None), params(None, seed=7)])
    outputs = [o.outputs[0] for o in llm.generate(prompts, sampling, use_tqdm=False)]
    for (_, _, check), output in zip(cases + bounded, outputs):
        assert output.finish_reason == "stop", f"{output.text!r} ended by {output.finish_reason}"
        check(output.text)
    return {"structured": [o.token_ids for o in outputs[:-2]], "neighbours": [o.token_ids for o in outputs[-2:]]}


def neighbours_alone(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(NEIGHBOURS, [params(None), params(None, seed=7)], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    with LLM(smollm2_dir, dtype="float32") as llm:
        yield llm


@pytest.fixture(scope="module")
def default_run(llm) -> dict:
    return run_mixed_batch(llm)


def test_every_output_matches_its_grammar_and_neighbours_are_unchanged(llm, default_run):
    assert default_run["neighbours"] == neighbours_alone(llm)


@pytest.mark.parametrize("engine_path", ["preemption", "chunked_prefill"])
def test_engine_paths_keep_outputs_valid(smollm2_dir, engine_path):
    # A KV cache too small for the batch makes requests give up their blocks and recompute, matcher state kept.
    options = {"preemption": dict(num_kvcache_blocks=40), "chunked_prefill": dict(max_num_batched_tokens=32,
                                                                                  max_num_seqs=32)}[engine_path]
    with LLM(smollm2_dir, dtype="float32", **options) as llm:
        run = run_mixed_batch(llm)
        assert run["neighbours"] == neighbours_alone(llm)
        if engine_path == "preemption":
            assert llm.stats().num_preemptions > 0


def test_two_ranks_give_the_same_structured_tokens_as_one(sharp_tiny_model):
    """SmolLM2's 9 heads do not split in two, so a tiny Llama with its tokenizer stands in; a random model writes
    whatever its grammar allows, so only the grammars that bound the output's length are used."""
    runs = []
    for size in (1, 2):
        with LLM(sharp_tiny_model[0], dtype="float32", tensor_parallel_size=size) as llm:
            runs.append(run_mixed_batch(llm, only_bounded=True))
    assert runs[0] == runs[1]


def test_streamed_deltas_join_into_the_final_json(llm):
    schema = SCHEMAS[5]
    engine = llm.llm_engine
    streamed = SamplingParams(temperature=0, max_tokens=96, output_kind=RequestOutputKind.DELTA,
                              structured_outputs=Structured(json=schema))
    engine.add_request("delta", "Describe some people as JSON:", streamed)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += [o.outputs[0].text for o in engine.step()]
    final = llm.generate("Describe some people as JSON:", params(Structured(json=schema)), use_tqdm=False)
    assert "".join(deltas) == final[0].outputs[0].text
    check_json(schema)("".join(deltas))


def test_chat_takes_structured_params(llm):
    messages = [{"role": "user", "content": "Name a color."}]
    output = llm.chat(messages, params(Structured(json=SCHEMAS[1])), use_tqdm=False)[0].outputs[0]
    check_json(SCHEMAS[1])(output.text)


def test_a_completed_grammar_ends_the_request_before_min_tokens(llm):
    """The grammar wins over min_tokens: once the output is complete, the stop token may come (no all -inf row)."""
    sampling = SamplingParams(temperature=0, max_tokens=32, min_tokens=20,
                              structured_outputs=Structured(choice=CHOICES))
    output = llm.generate("The capital of Italy is", sampling, use_tqdm=False)[0].outputs[0]
    assert output.text in CHOICES and output.finish_reason == "stop"
    assert len(output.token_ids) < 20


def test_max_tokens_ends_an_unfinished_grammar_with_length(llm):
    sampling = SamplingParams(temperature=0, max_tokens=3, structured_outputs=Structured(json=SCHEMAS[0]))
    output = llm.generate("Describe a person as JSON:", sampling, use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "length" and len(output.token_ids) == 3


def test_logprobs_are_the_raw_model_logprobs(llm, smollm2_dir):
    """The mask decides what may be sampled; logprobs still report what the model itself thought."""
    prompt = "The capital of France is"
    sampling = SamplingParams(temperature=0, max_tokens=1, logprobs=0, structured_outputs=Structured(choice=["Rome"]))
    output = llm.generate(prompt, sampling, use_tqdm=False)[0]
    token = output.outputs[0].token_ids[0]
    hf_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf_model(torch.tensor([output.prompt_token_ids])).logits[0, -1]
    expected = logits.log_softmax(-1)[token].item()
    assert output.outputs[0].logprobs[0][token].logprob == pytest.approx(expected, abs=1e-4)
    assert expected < logits.log_softmax(-1).max().item()  # the mask forced a token the model did not favour


def test_a_rejected_token_ends_only_its_request(llm, monkeypatch):
    engine = llm.llm_engine
    engine.add_request("doomed", "Describe a person as JSON:", params(Structured(json=SCHEMAS[0])))
    engine.add_request("bystander", "Describe a person as JSON:", params(Structured(json=SCHEMAS[0])))
    monkeypatch.setattr(engine.requests["doomed"].matcher, "accept_token", lambda token_id: False, raising=False)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert finished["doomed"].finish_reason == "error"
    assert "structured_outputs" in finished["doomed"].stop_reason
    assert finished["bystander"].finish_reason == "stop"
    check_json(SCHEMAS[0])(finished["bystander"].text)


BAD_CONSTRAINTS = [
    (lambda: Structured(json="{not json"), "structured_outputs.json"),
    (lambda: Structured(json={"type": "no-such-type"}), "structured_outputs.json"),
    (lambda: Structured(regex="([0-9]"), "structured_outputs.regex"),
    (lambda: Structured(grammar="root ::= "), "structured_outputs.grammar"),
    (lambda: Structured(choice=[]), "structured_outputs.choice"),
    (lambda: Structured(regex="a", choice=["b"]), "structured_outputs needs exactly one"),
    (lambda: Structured(), "structured_outputs needs exactly one"),
    (lambda: Structured(regex=5), "structured_outputs.regex must be a str"),
    (lambda: SamplingParams(structured_outputs={"json": {}}), "structured_outputs must be a StructuredOutputsParams"),
]


def test_bad_constraints_raise_before_queueing_and_the_engine_keeps_serving(llm):
    engine = llm.llm_engine
    engine.add_request("running", "Describe a person as JSON:", params(Structured(json=SCHEMAS[0])))
    engine.step()
    for constraint, error in BAD_CONSTRAINTS:
        with pytest.raises((ValueError, TypeError), match=re.escape(error)):
            llm.generate("Hello", params(constraint()), use_tqdm=False)
        assert list(engine.requests) == ["running"]
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    alone = llm.generate("Describe a person as JSON:", params(Structured(json=SCHEMAS[0])), use_tqdm=False)
    assert outputs[-1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_speculation_gives_the_same_structured_tokens(smollm2_dir, default_run):
    """Drafts are cut where the grammar rejects them, and each drafted row is masked from the matcher's state
    after the drafts before it: greedy and seeded outputs stay token for token those without drafts."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    with LLM(smollm2_dir, dtype="float32", speculative_config=spec) as llm:
        keep_every_draft(llm.llm_engine)
        run = run_mixed_batch(llm)
        stats = llm.stats()
    assert run == default_run
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_drafts_are_cut_at_the_first_token_the_grammar_rejects(llm):
    manager = llm.llm_engine.processor.structured_output_manager()
    tokenizer = llm.get_tokenizer()
    matcher = manager.new_matcher(Structured(choice=["Paris is big", "Rome"]), llm.llm_engine.processor.eos_token_ids)
    paris = tokenizer.encode("Paris is big")
    drafts = paris[:2] + tokenizer.encode(" London")
    assert grammar_prefix(matcher, drafts) == paris[:2]
    eos = sorted(llm.llm_engine.processor.eos_token_ids)[0]
    assert grammar_prefix(matcher, paris + [eos]) == paris  # the stop token is left to its own row
    mask = manager.bitmask_for([matcher, None], [paris[:2], [5]])
    assert mask.rows == [0, 1, 2] and mask.bitmask.shape[0] == 5
    for row, prefix in enumerate([[], paris[:1], paris[:2]]):  # each row: what may follow the drafts before it
        allowed = set(xgr_allowed(mask.bitmask[row], manager.vocab_size))
        follow = paris[len(prefix)] if len(prefix) < len(paris) else None
        assert follow in allowed and tokenizer.encode(" London")[0] not in allowed
    assert grammar_prefix(matcher, paris) == paris  # the matcher was rolled back: it still starts at the start


def xgr_allowed(row: torch.Tensor, vocab_size: int) -> list[int]:
    bits = row.view(torch.uint8).numpy()
    return [i for i in range(vocab_size) if bits[i // 8] >> (i % 8) & 1]
