"""Accuracy of an output against a float64 reference."""

from __future__ import annotations

import torch
from torch import Tensor


def accuracy(out: Tensor, ref: Tensor) -> dict[str, float]:
    """Relative L2 and L1 errors, mean squared error, max abs error and cosine similarity, in float64.

    NaN or inf in ``out`` gives every error inf and cosine nan, so it never passes.
    """
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    o, r = out.detach().double().flatten(), ref.detach().double().flatten()
    if not torch.isfinite(o).all():
        inf = float("inf")
        return {"rel_l2": inf, "rel_l1": inf, "mse": inf, "max_abs_err": inf, "cosine": float("nan")}
    diff = o - r
    ref_norm = torch.linalg.vector_norm(r)
    rel_l2 = torch.linalg.vector_norm(diff) / ref_norm if ref_norm > 0 else torch.linalg.vector_norm(diff)
    ref_l1 = r.abs().sum()
    rel_l1 = diff.abs().sum() / ref_l1 if ref_l1 > 0 else diff.abs().sum()
    cosine = torch.nn.functional.cosine_similarity(o, r, dim=0, eps=1e-300)
    return {"rel_l2": float(rel_l2), "rel_l1": float(rel_l1), "mse": float(diff.square().mean()),
            "max_abs_err": float(diff.abs().max()), "cosine": float(cosine)}
