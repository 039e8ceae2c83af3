"""The whole engine on the Triton backend (interpreted on the CPU) gives the torch backend's tokens.

Triton decides at import time whether to interpret kernels, so the Triton run
happens in a child process with TRITON_INTERPRET=1 set from the start.
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import build_tiny_model

from nanoengine import LLM, SamplingParams

PROMPTS = [[11, 12, 13], list(range(100, 137)), [7] * 16, list(range(300, 321))]
OPTIONS = dict(max_model_len=128, max_num_batched_tokens=32, num_kvcache_blocks=32)
CHILD = """
import json, sys
from nanoengine import LLM, SamplingParams
options = json.loads(sys.argv[2])
with LLM(sys.argv[1], attention_backend="triton", **options) as llm:
    outputs = llm.generate(json.loads(sys.argv[3]), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           use_tqdm=False)
print(json.dumps([o.outputs[0].token_ids for o in outputs]))
"""


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_triton_backend_matches_torch_backend(arch, tmp_path, smollm2_dir):
    build_tiny_model(arch, tmp_path, smollm2_dir)
    with LLM(str(tmp_path), attention_backend="torch", **OPTIONS) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)]
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), json.dumps(OPTIONS), json.dumps(PROMPTS)],
                           env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    assert json.loads(child.stdout.strip().splitlines()[-1]) == expected


def test_triton_on_cpu_without_the_interpreter_is_refused(tmp_path, smollm2_dir, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    build_tiny_model("qwen3", tmp_path, smollm2_dir)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        LLM(str(tmp_path), attention_backend="triton", device="cpu")
