"""Accuracy of an output against a float64 reference."""

from __future__ import annotations

import torch
from torch import Tensor


def accuracy(out: Tensor, ref: Tensor) -> dict[str, float]:
    """Relative L2 error, max abs error and cosine similarity, computed in float64.

    NaN or inf in ``out`` gives rel_l2 = max_abs = inf and cosine = nan, so it never passes.
    """
    if out.shape != ref.shape:
        raise ValueError(f"output shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    o, r = out.detach().double().flatten(), ref.detach().double().flatten()
    if not torch.isfinite(o).all():
        return {"rel_l2": float("inf"), "max_abs_err": float("inf"), "cosine": float("nan")}
    diff = o - r
    ref_norm = torch.linalg.vector_norm(r)
    rel_l2 = torch.linalg.vector_norm(diff) / ref_norm if ref_norm > 0 else torch.linalg.vector_norm(diff)
    cosine = torch.nn.functional.cosine_similarity(o, r, dim=0, eps=1e-300)
    return {"rel_l2": float(rel_l2), "max_abs_err": float(diff.abs().max()), "cosine": float(cosine)}
