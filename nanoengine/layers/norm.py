import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The norm of x; or, given the residual stream, its sum with x (the next residual) and the norm of
        that: (norm, residual)."""
        if residual is None:
            return self.normalize(x)
        residual = residual + x
        return self.normalize(residual), residual

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        # Normalized in float32, scaled in the model's dtype, as Hugging Face's checkpoints were trained.
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * normed.to(x.dtype)
