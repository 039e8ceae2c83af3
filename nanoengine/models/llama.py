"""Llama-family decoder: Llama (and SmolLM2), Qwen2 (biased QKV) and, with q/k norm, Qwen3.

Hugging Face's separate q/k/v and gate/up projections are merged into one
matmul each; ``packed_modules`` tells the loader which checkpoint tensor goes
into which shard of which merged parameter.
"""

import torch
from torch import nn
from transformers import PretrainedConfig

from nanoengine.attention.metadata import AttentionMetadata
from nanoengine.distributed import tp_size
from nanoengine.layers.activation import SiluAndMul
from nanoengine.layers.attention import Attention
from nanoengine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoengine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoengine.layers.norm import RMSNorm
from nanoengine.layers.rotary import RotaryEmbedding, Rotation


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_parameters_of(config: PretrainedConfig) -> dict:
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return rope


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads // tp_size()
        self.num_kv_heads = config.num_key_value_heads // tp_size()
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias)
        # Llama and Qwen3 put attention_bias on every projection; Qwen2 biases q/k/v only.
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=getattr(config, "attention_bias", False))
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, rotation: Rotation, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotation.apply(q), rotation.apply(k)
        out = self.attn(q, k, v, meta)
        return self.o_proj(out.flatten(1))


class DecoderMLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        if getattr(config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.self_attn = DecoderAttention(config, qkv_bias, qk_norm)
        self.mlp = DecoderMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rotation: Rotation, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the layer before's output; residual: the stream it is added to (None at the first layer).
        Each norm adds what came before it into the stream, in one pass, as vLLM's models do."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rotation, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, qk_norm: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                          rope_parameters_of(config))
        self.layers = nn.ModuleList(
            DecoderLayer(config, qkv_bias, qk_norm) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        rotation = self.rotary_emb(positions, hidden.dtype)
        for layer in self.layers:
            hidden, residual = layer(rotation, hidden, residual, meta)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    qkv_bias: bool | None = None  # None: as the config's attention_bias says
    qk_norm = False
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig):
        super().__init__()
        # Features this decoder lacks fail here, at load, rather than change the model's output (docs/models.md).
        if getattr(config, "use_sliding_window", getattr(config, "sliding_window", None) is not None):
            raise ValueError("use_sliding_window=True is not supported (every layer attends to its whole context)")
        if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
            raise ValueError("mixture-of-experts layers are not supported")
        qkv_bias = self.qkv_bias if self.qkv_bias is not None else getattr(config, "attention_bias", False)
        self.model = DecoderModel(config, qkv_bias, self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 is Llama with a bias on the q/k/v projections."""

    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 is Llama with an RMSNorm on each query and key head before rotary."""

    qk_norm = True
