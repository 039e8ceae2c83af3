"""The int8 quantizer that the int8 KV cache and int8 weights share: symmetric, one scale per vector."""

import torch


def quantize(x: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each vector of ``x``'s last dimension as int8 and its float32 scale absmax / 127, rounded half to even;
    an all-zero vector gets scale 0 and zeros. ``absmax``: each vector's largest magnitude, where it is not
    this one's own (a row-parallel shard of a weight's rows)."""
    x = x.float()
    scales = (x.abs().amax(dim=-1) if absmax is None else absmax) / 127
    divisors = torch.where(scales > 0, scales, 1)[..., None]  # a zero vector divided by 1 stays zero
    return torch.round(x / divisors).clamp(-127, 127).to(torch.int8), scales
