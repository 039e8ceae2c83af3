"""Three small requests through the real engine, step by step: the script behind docs/walkthrough.md.

    python docs/walkthrough.py [--model DIR]

Prints the step trace, the block hashes behind a prefix-cache hit, and for one step the packed
batch (token ids, positions, slot mapping, query offsets, block tables) and the cache slots that
each query row's attention reads through its block table.
"""

import argparse
import logging
import sys

from nanoengine import LLM, SamplingParams
from nanoengine.engine.block_manager import hash_block
from nanoengine.engine.model_runner import StepInputs
from nanoengine.utils.default_model import default_model_path

PROMPTS = {
    "A": "The capital of France is Paris. The capital of Germany is Berlin. The capital of",
    "B": "The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is",
    "C": "A KV cache keeps the keys and values of every token that a model has already seen, so that each new "
         "token attends to them without computing them again. Its blocks",
}
PACKED_STEP = 2  # the step whose batch is drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    logging.getLogger("nanoengine.trace").addHandler(logging.StreamHandler(sys.stdout))  # the trace, inline

    # A 20-token step budget and 7 blocks of 16 tokens: small enough to see chunking and a preemption.
    llm = LLM(args.model or default_model_path(), trace=True, max_num_batched_tokens=20, num_kvcache_blocks=7,
              max_model_len=112)
    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    ids = {name: tokenizer.encode(text) for name, text in PROMPTS.items()}
    for name, token_ids in ids.items():
        print(f"{name}: {len(token_ids)} prompt tokens")
    show_packing_of_step(llm, PACKED_STEP)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    engine.add_request("A", {"prompt_token_ids": ids["A"]}, params)
    engine.step()  # A alone: admitted, its whole prompt in one step
    engine.add_request("B", {"prompt_token_ids": ids["B"]}, params)
    engine.add_request("C", {"prompt_token_ids": ids["C"]}, params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                print(f"{output.request_id} finished: {len(output.outputs[0].token_ids)} tokens")
        if engine.trace.num_steps == 2:
            show_prefix_hit(llm, ids["B"])
    print(f"preemptions: {llm.stats().num_preemptions}")
    llm.close()


def show_prefix_hit(llm: LLM, prompt: list[int]) -> None:
    """B's first block: its hash, recomputed here, is the one A's block 0 was registered under."""
    bm = llm.llm_engine.block_manager
    first = hash_block(None, prompt[:bm.block_size], None)
    print(f"B's block 0: tokens {prompt[:bm.block_size]}")
    print(f"  hash {first:016x}, held by block {bm.cached_blocks[first].block_id}")
    print(f"  the same tokens with cache_salt 'tenant-7' hash to {hash_block(None, prompt[:16], 'tenant-7'):016x}")
    print(f"  block 1's hash chains from block 0's: {hash_block(first, prompt[16:32], None):016x}")


def show_packing_of_step(llm: LLM, step_number: int) -> None:
    """Wrap the executor so that it prints the flat batch of one step before running it."""
    executor, engine = llm.llm_engine.model_executor, llm.llm_engine
    execute = executor.execute_model

    def execute_and_show(step, *args):
        if engine.trace.num_steps == step_number:
            print_packing(executor.runner, step)
        return execute(step, *args)
    executor.execute_model = execute_and_show


def print_packing(runner, step) -> None:
    inputs = StepInputs.of(step)
    input_ids, positions, meta, sample_rows = runner.prepare_inputs(inputs)
    owner = [rid for rid, tokens in zip(inputs.request_ids, inputs.token_ids) for _ in tokens]
    print(f"packed batch of step {PACKED_STEP}:")
    print("  row | request | token id | position | slot = block * 16 + offset")
    for row, (token, pos, slot) in enumerate(zip(input_ids.tolist(), positions.tolist(),
                                                  meta.slot_mapping.tolist())):
        print(f"  {row:3} | {owner[row]:7} | {token:8} | {pos:8} | {slot:4} = {slot // 16} * 16 + {slot % 16}")
    print(f"  query_start_loc {meta.query_start_loc_cpu}   seq_lens {meta.seq_lens_cpu}")
    print(f"  block_tables {meta.block_tables.tolist()}   rows that sample {sample_rows.tolist()}")
    print("attention reads, per request, through its block table:")
    for i, rid in enumerate(inputs.request_ids):
        first_row, last_row = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1] - 1
        seq_len, query_len = meta.seq_lens_cpu[i], last_row - first_row + 1
        reads = ", ".join(f"block {b} slots {b * 16}..{b * 16 + min(16, seq_len - j * 16) - 1}"
                          for j, b in enumerate(meta.block_tables[i, :-(-seq_len // 16)].tolist()))
        print(f"  {rid}: rows {first_row}..{last_row} = positions {seq_len - query_len}..{seq_len - 1}, "
              f"keys 0..{seq_len - 1}: {reads}")


if __name__ == "__main__":
    main()
