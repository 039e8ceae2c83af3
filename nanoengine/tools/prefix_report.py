"""``nanoengine prefix-report REQUESTS.jsonl``: which part of a prompt template breaks prefix-cache reuse.

Each line is one request body (``prompt``, ``prompt_token_ids`` or ``messages``, with an optional
``cache_salt``), validated and tokenized by the engine's own ``make_request`` and replayed in file order
through the engine's ``BlockManager``, as if each ran alone; no weights are loaded. Per request: its
prompt and cached tokens, and where it departs from the earlier prompt that shares the most with it
(docs/prefix-caching.md).
"""

import argparse
import bisect
import json
import sys
from collections import Counter
from dataclasses import dataclass, field

from jinja2 import TemplateError

from nanoengine.config import EngineConfig
from nanoengine.engine.block_manager import BlockManager
from nanoengine.engine.processor import Processor
from nanoengine.engine.request import Request
from nanoengine.sampling_params import SamplingParams
from nanoengine.serve.protocol import ChatCompletionRequest
from nanoengine.utils.default_model import default_model_path
from nanoengine.utils.plots import new_figure

CONTEXT_TOKENS = 10  # decoded on either side of a divergence
TOP_GROUPS = 5


@dataclass
class Entry:
    line: int
    request: Request
    message_ends: list[int] | None = None  # chat: the token position where each message's rendering ends
    roles: list[str] = field(default_factory=list)


def read_requests(path: str, validator: Processor) -> tuple[list[Entry], list[dict]]:
    entries, errors = [], []
    with open(path) as lines:
        for number, text in enumerate(lines, start=1):
            if text.strip():
                try:
                    entries.append(parse_line(number, text, validator))
                except (ValueError, TypeError, TemplateError) as error:
                    errors.append({"line": number, "error": str(error)})
    return entries, errors


def parse_line(number: int, text: str, validator: Processor) -> Entry:
    body = json.loads(text)
    if not isinstance(body, dict):
        raise ValueError("a line must be a JSON object (one request body)")
    kinds = [key for key in ("prompt", "prompt_token_ids", "messages") if key in body]
    if len(kinds) != 1:
        raise ValueError("a request needs exactly one of 'prompt', 'prompt_token_ids' and 'messages'")
    params, rid = SamplingParams(max_tokens=1), f"line-{number}"
    if kinds[0] != "messages":
        prompt = {kinds[0]: body[kinds[0]], "cache_salt": body.get("cache_salt")}
        return Entry(number, validator.make_request(rid, prompt, params))
    chat = ChatCompletionRequest.model_validate(body)  # the server's own parsing of a chat body
    messages = [m.for_template() for m in chat.messages]
    _, token_ids = validator.render_chat(messages, add_generation_prompt=chat.add_generation_prompt)
    request = validator.make_request(rid, {"prompt_token_ids": token_ids, "cache_salt": chat.cache_salt}, params)
    ends = [len(validator.render_chat(messages[:k + 1])[1]) for k in range(len(messages))]
    return Entry(number, request, ends, [m["role"] for m in messages])


def replay(requests: list[Request], num_blocks: int, block_size: int) -> list[int]:
    """Each request's cached tokens when they run one at a time, in order, on a fresh cache."""
    bm = BlockManager(num_blocks, block_size)
    cached = []
    for request in requests:
        prefix = bm.find_cached_prefix(request)
        if not bm.allocate_slots(request, request.num_tokens - len(prefix) * block_size, prefix):
            raise ValueError(f"a prompt of {request.num_tokens} tokens does not fit in {num_blocks} blocks")
        cached.append(len(prefix) * block_size)
        request.num_computed_tokens = request.num_tokens
        bm.free(request)
        request.num_computed_tokens = 0
    return cached


def common_prefix(a: tuple, b: tuple) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def closest_earlier(entries: list[Entry]) -> list[tuple[int, int] | None]:
    """Per request, (the earlier entry that shares its longest prefix, that length), or None when none shares a
    token. The longest common prefix with a sorted set is found next to where the prompt would sort in."""
    seen: list[tuple[str, tuple, int]] = []  # (salt, token ids, entry index), sorted
    found = []
    for index, entry in enumerate(entries):
        key = (entry.request.cache_salt or "", tuple(entry.request.prompt_token_ids), index)
        at = bisect.bisect_left(seen, key)
        neighbours = [seen[i] for i in (at - 1, at) if 0 <= i < len(seen) and seen[i][0] == key[0]]
        best = max(((common_prefix(key[1], n[1]), n[2]) for n in neighbours), default=(0, None))
        found.append((best[1], best[0]) if best[0] else None)
        seen.insert(at, key)
    return found


def report(entries: list[Entry], tokenizer, num_blocks: int | None, block_size: int) -> dict:
    requests = [e.request for e in entries]
    unbounded = sum(-(-r.num_tokens // block_size) for r in requests) or 1
    cached = replay(requests, num_blocks or unbounded, block_size)
    rows = []
    for entry, cached_tokens, closest in zip(entries, cached, closest_earlier(entries)):
        ids = entry.request.prompt_token_ids
        row = {"line": entry.line, "prompt_tokens": len(ids), "cached_tokens": cached_tokens, "diverges_at": None,
               "diverges_in_block": None, "closest_line": None, "divergence_text": None}
        if closest is not None:
            at = closest[1]
            row.update(diverges_at=at, diverges_in_block=at // block_size, closest_line=entries[closest[0]].line,
                       divergence_text=tokenizer.decode(ids[max(0, at - CONTEXT_TOKENS):at]) + "|"
                       + tokenizer.decode(ids[at:at + CONTEXT_TOKENS]))
        if entry.message_ends is not None:  # past the last message's end lies the generation prompt
            i = None if closest is None else bisect.bisect_right(entry.message_ends, closest[1])
            in_message = i is not None and i < len(entry.roles)
            row.update(message_index=i if in_message else None, message_role=entry.roles[i] if in_message else None)
        rows.append(row)
    return {"requests": rows, "summary": summarize(rows, requests, block_size)}


def summarize(rows: list[dict], requests: list[Request], block_size: int) -> dict:
    prompt_tokens = sum(r["prompt_tokens"] for r in rows)
    cached_tokens = sum(r["cached_tokens"] for r in rows)
    places = Counter(f"messages[{r['message_index']}] ({r['message_role']})" for r in rows
                     if r.get("message_index") is not None)
    return {"requests": len(rows), "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
            "shared_prefix_groups": prefix_groups(requests, [r["line"] for r in rows], block_size),
            "divergence_messages": [{"message": m, "requests": n} for m, n in places.most_common()]}


def prefix_groups(requests: list[Request], lines: list[int], block_size: int) -> list[dict]:
    """The largest groups of requests that share whole blocks: a chain of block hashes, cut where fewer
    requests share the next block."""
    holders: dict[int, list[int]] = {}  # block hash -> lines of the requests whose prompt holds it
    depth, longest_child = {}, Counter()
    for request, line in zip(requests, lines):
        hashes = request.block_hashes[:request.num_prompt_tokens // block_size]
        for i, block_hash in enumerate(hashes):
            holders.setdefault(block_hash, []).append(line)
            depth[block_hash] = i + 1
    for request in requests:
        hashes = request.block_hashes[:request.num_prompt_tokens // block_size]
        for parent, child in zip(hashes, hashes[1:]):
            longest_child[parent] = max(longest_child[parent], len(holders[child]))
    groups = [{"requests": len(held), "shared_tokens": depth[h] * block_size, "lines": held[:10]}
              for h, held in holders.items() if len(held) > max(1, longest_child[h])]
    return sorted(groups, key=lambda g: (g["requests"], g["shared_tokens"]), reverse=True)[:TOP_GROUPS]


def print_table(result: dict) -> None:
    print(f"{'line':>5} {'prompt':>7} {'cached':>7} {'diverges at':>12} {'from':>5}  {'message':<16} text around it")
    for r in result["requests"]:
        where = "" if r["diverges_at"] is None else f"{r['diverges_at']} (b{r['diverges_in_block']})"
        message = f"[{r['message_index']}] {r['message_role']}" if r.get("message_index") is not None else ""
        text = json.dumps(r["divergence_text"]) if r["divergence_text"] else ""
        print(f"{r['line']:>5} {r['prompt_tokens']:>7} {r['cached_tokens']:>7} {where:>12} "
              f"{r['closest_line'] or '':>5}  {message:<16} {text}".rstrip())
    s = result["summary"]
    print(f"\n{s['requests']} requests: {s['cached_tokens']:,} of {s['prompt_tokens']:,} prompt tokens cached "
          f"({s['hit_rate']:.1%})")
    for g in s["shared_prefix_groups"]:
        print(f"  {g['requests']} requests share {g['shared_tokens']} tokens (lines {g['lines']})")
    if s["divergence_messages"]:
        top = s["divergence_messages"][0]
        print(f"The first divergence lies most often in {top['message']} ({top['requests']} requests): move what "
              f"varies there after the shared part.")


def plot_hit_rate(entries: list[Entry], block_size: int, path: str) -> None:
    """The hit rate against the cache size, from the largest prompt's blocks up to no eviction at all."""
    fig = new_figure("the hit rate")
    requests = [e.request for e in entries]
    blocks = [-(-r.num_tokens // block_size) for r in requests]
    smallest, largest = max(blocks), sum(blocks)
    sizes = sorted({round(smallest * (largest / smallest) ** (i / 15)) for i in range(16)})
    total = sum(r.num_prompt_tokens for r in requests)
    rates = [sum(replay(requests, n, block_size)) / total for n in sizes]
    axes = fig.subplots()
    axes.plot(sizes, rates, marker="o")
    axes.set(xscale="log", xlabel=f"KV cache size (blocks of {block_size} tokens)", ylabel="prefix-cache hit rate",
             ylim=(0, 1))
    fig.savefig(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoengine prefix-report", description=__doc__.splitlines()[0])
    parser.add_argument("requests", help="a JSONL file, one request body per line")
    parser.add_argument("--model", help="a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--num-blocks", type=int, help="the KV cache's size in blocks (default: no eviction)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--plot", metavar="FILE", help="draw the hit rate against the cache size (matplotlib)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = EngineConfig.from_options(args.model or default_model_path(), {"kvcache_block_size": args.block_size,
                                                                                "device": "cpu"})
        if args.num_blocks is not None and args.num_blocks < 1:
            raise ValueError(f"--num-blocks must be >= 1, got {args.num_blocks}")
        validator = Processor(config)
        if args.num_blocks:  # the engine lowers max_model_len to what its KV cache holds
            config.max_model_len = min(config.max_model_len, args.num_blocks * args.block_size)
        entries, errors = read_requests(args.requests, validator)
    except (ValueError, TypeError, OSError) as error:
        parser.error(str(error))
    for error in errors:
        print(f"{args.requests}:{error['line']}: {error['error']}", file=sys.stderr)
    result = report(entries, validator.tokenizer, args.num_blocks, args.block_size)
    if args.json:
        print(json.dumps({**result, "errors": errors}, indent=1))
    else:
        print_table(result)
    if args.plot and entries:
        plot_hit_rate(entries, args.block_size, args.plot)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
