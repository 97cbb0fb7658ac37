"""Real attention inputs for studies other than the rank study: the q, k, v of all-MiniLM-L6-v2 that the
``real_inputs`` stage captures (``experiments/rank/capture.py``; the file's writer and its layout are
``experiments/rank/minilm.py``'s, format 1). Read here so that no study imports another's code."""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

CAPTURE = Path("data/real_inputs/minilm_qkv.pt")  # the real_inputs stage's output (repo root relative)
FORMAT = 1
HEADS, HEAD_DIM = 12, 32  # all-MiniLM-L6-v2's attention heads


def captured_qkv(seq_len: int, layer: int, path: Path = CAPTURE) -> tuple[Tensor, Tensor, Tensor]:
    """MiniLM's (q, k, v) at ``layer`` over a window of ``seq_len`` word pieces, each (1, HEADS, seq_len, HEAD_DIM)
    fp32 on the CPU; a one-line error naming what the file lacks."""
    how = "run `dvc repro real_inputs` where the model is installed"
    if not path.exists():
        raise RuntimeError(f"real attention inputs: {path} is missing: {how}")
    payload = _load(path, path.stat().st_mtime_ns)
    if payload.get("format") != FORMAT:
        raise RuntimeError(f"real attention inputs: {path} has format {payload.get('format')!r}, not {FORMAT}: {how}")
    if seq_len not in payload["qkv"] or layer not in payload["layers"]:
        raise RuntimeError(f"real attention inputs: {path} holds windows of {sorted(payload['qkv'])} and layers "
                           f"{payload['layers']}, not {seq_len} and {layer}: {how}")
    x = payload["qkv"][seq_len][payload["layers"].index(layer)]  # (3, heads, S, head dim)
    return x[0][None], x[1][None], x[2][None]


@functools.lru_cache(maxsize=1)
def _load(path: Path, mtime_ns: int) -> dict:  # mtime in the key: a new capture is read again
    return torch.load(path, map_location="cpu", weights_only=True)
