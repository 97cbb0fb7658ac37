"""The Newton-Schulz pseudo-inverse of Nyström attention's landmark kernel: the PyTorch path of
``attention.rank`` and the batched solve of the fused kernels (``kernels.nystrom``) run the same iteration."""

from __future__ import annotations

import torch
from torch import Tensor


def pinv(a: Tensor, iters: int) -> Tensor:
    """Iterative Moore-Penrose inverse (Razavi et al. 2014, as Nyströmformer), differentiable and batched:
    z <- z (13 I - a z (15 I - a z (7 I - a z))) / 4, each "c I - x y" one fused batched matmul."""
    shape, n = a.shape, a.shape[-1]
    a = a.reshape(-1, n, n)
    eye = torch.eye(n, device=a.device, dtype=a.dtype)
    eye7, eye15, eye13_4 = 7 * eye, 15 * eye, 3.25 * eye  # few launches per iteration: host time on a GPU
    z = a.transpose(1, 2) / (a.abs().sum(2).amax(1) * a.abs().sum(1).amax(1))[:, None, None]
    for _ in range(iters):
        az = torch.bmm(a, z)
        t = torch.baddbmm(eye15, az, eye7 - az, alpha=-1)
        z = torch.bmm(z, torch.baddbmm(eye13_4, az, t, alpha=-0.25))
    return z.view(shape)
