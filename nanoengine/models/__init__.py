"""The model registry: Hugging Face ``architectures`` name -> our implementation."""

from torch import nn
from transformers import PretrainedConfig

from nanoengine.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class_for(config: PretrainedConfig) -> type[nn.Module]:
    for architecture in getattr(config, "architectures", None) or []:
        if architecture in MODEL_REGISTRY:
            return MODEL_REGISTRY[architecture]
    raise ValueError(f"unsupported architecture {config.architectures}; supported: {sorted(MODEL_REGISTRY)}")
