"""The ``models`` stage: one model card per preset of params.yaml ``models`` (``models/<preset>.json``), what every
model-level table reads (parameters, FLOPs per token, a training step's memory by component)."""

from __future__ import annotations

import json
from pathlib import Path

from adaattn.models.card import model_card
from adaattn.models.config import ModelConfig


def write_card(preset: str, cfg: ModelConfig, out: Path = Path("models"), check: bool = True) -> str:
    """Build ``preset`` and write its card; a line saying what it holds. A failed build leaves the last card."""
    body = model_card(preset, cfg, check=check)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{preset}.json.tmp"
    tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    tmp.replace(out / f"{preset}.json")
    p, f = body["params"], body["flops_per_token"]
    return (f"{preset}: {p['total'] / 1e6:.1f}M parameters ({p['matmul'] / 1e6:.1f}M in matmuls), "
            f"{f['formula']['train'] / 1e9:.2f} GFLOP per training token at S={f['seq_len']} "
            f"(counter / formula {f['counted_over_formula']:.3f}); wrote {out / (preset + '.json')}")
