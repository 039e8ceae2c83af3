"""Load a Hugging Face safetensors checkpoint into a model whose parameters know their shards."""

import glob
import os

import torch
from safetensors import safe_open
from torch import nn


def checkpoint_files(model_dir: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir!r}")
    return files


def load_model(model: nn.Module, model_dir: str) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    loaded = set()
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                loaded.add(load_tensor(params, packed, name, f.get_tensor(name)))
    check_all_loaded(params, loaded, model_dir)


def check_all_loaded(params: dict[str, nn.Parameter], loaded: set[str], source: str) -> None:
    missing = {name for name, p in params.items() if name not in loaded and not is_tied_to_loaded(p, params, loaded)}
    if missing:
        raise ValueError(f"checkpoint in {source!r} lacks weights: {sorted(missing)[:5]}")


def target_of(packed: dict, name: str) -> tuple[str, str | int | None]:
    """The parameter a checkpoint tensor loads into, and its shard there (None: the whole parameter)."""
    for hf_part, (our_part, shard_id) in packed.items():
        if f".{hf_part}." in name:
            return name.replace(f".{hf_part}.", f".{our_part}."), shard_id
    return name, None


def load_tensor(params: dict[str, nn.Parameter], packed: dict, name: str, tensor: torch.Tensor) -> str:
    target, shard_id = target_of(packed, name)
    if shard_id is not None:
        param = parameter(params, target)
        param.weight_loader(param, tensor, shard_id)
        return target
    param = parameter(params, name)
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        param.data.copy_(tensor)
    else:
        loader(param, tensor)
    return name


def parameter(params: dict[str, nn.Parameter], name: str) -> nn.Parameter:
    if name not in params:
        raise ValueError(f"checkpoint weight {name!r} has no place in the model")
    return params[name]


def is_tied_to_loaded(param: nn.Parameter, params: dict[str, nn.Parameter], loaded: set[str]) -> bool:
    return any(params[name] is param for name in loaded)
