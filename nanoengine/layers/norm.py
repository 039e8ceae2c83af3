import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    cpu_ops = None  # the C++ kernels (layers/cpu_ops.cpp), set by the model runner on the CPU

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """The norm of x; or, given the residual stream, its sum with x (the next residual, and on the CPU
        ``residual`` itself, updated in place) and the norm of that: (norm, residual)."""
        if residual is None:
            return self.normalize(x)
        if self.cpu_ops is not None:
            out = torch.empty(x.shape, dtype=x.dtype)
            self.cpu_ops.add_rms_norm(x, residual, self.weight, self.eps, out)
            return out, residual
        residual = residual + x
        return self.normalize(residual), residual

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_ops is not None:
            out = torch.empty(x.shape, dtype=x.dtype)
            self.cpu_ops.rms_norm(x, self.weight, self.eps, out)
            return out
        # Normalized in float32, scaled in the model's dtype, as Hugging Face's checkpoints were trained.
        normed = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)
        return self.weight * normed.to(x.dtype)
