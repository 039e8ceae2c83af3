"""vLLM's offline examples, in our own words under examples/, run as scripts against SmolLM2: the same calls
work with only the import and the model path changed."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "offline_inference"
SMALL_ENGINE = ["--max-model-len", "512"]


def run_example(script: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # this checkout's nanoengine
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_basic(smollm2_dir):
    lines = run_example("basic/basic.py", smollm2_dir).splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "Prompt: 'Hello", "Prompt: 'The president of the United States is'", "Prompt: 'The capital of France is'",
        "Prompt: 'The future of AI is'"]


def test_generate_takes_engine_args_and_the_default_sampling_params(smollm2_dir):
    out = run_example("basic/generate.py", "--model", smollm2_dir, *SMALL_ENGINE, "--max-tokens", "3",
                      "--temperature", "0")
    assert "Prompt: 'The capital of France is', Generated text: ' Paris.\\n'" in out


def test_chat_with_the_models_template_and_one_from_a_file(smollm2_dir, tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    out = run_example("basic/chat.py", "--model", smollm2_dir, *SMALL_ENGINE, "--max-tokens", "2",
                      "--temperature", "0", "--chat-template-path", str(template))
    assert out.count("Generated text:") == 1 + 10 + 10
    assert out.count("Prompt: '<|im_start|>system\\nYou are a helpful assistant") == 1 + 10
    assert out.count("Prompt: 'system: You are a helpful assistant\\nuser: Hello") == 10


def test_automatic_prefix_caching(smollm2_dir):
    out = run_example("automatic_prefix_caching.py", smollm2_dir)
    assert [line for line in out.splitlines() if line.startswith("Output:")] == ["Output: 29.", "Output: 30."]


def test_llm_engine_example(smollm2_dir):
    out = run_example("llm_engine_example.py", "--model", smollm2_dir, *SMALL_ENGINE)
    finished = [line for line in out.splitlines() if line.startswith("RequestOutput(")]
    assert sorted(line.split(",")[0] for line in finished) == [f"RequestOutput(request_id='{i}'" for i in range(3)]
    assert all("finished=True" in line for line in finished)

