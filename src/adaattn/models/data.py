"""Real text every machine has: Python's standard-library sources, as bytes (a vocabulary of 256, no
tokenizer to ship). A held-out share of the files is the validation split, chosen by a hash of each file's
path, so that the split does not move when a file is added elsewhere. The corpus differs between Python
versions: ``Corpus.info`` says which one a run read (files, bytes, a digest)."""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

VOCAB = 256  # bytes


@dataclass(frozen=True)
class Corpus:
    train: Tensor  # uint8, the training files' bytes back to back
    val: Tensor  # uint8, the held-out files'
    info: dict[str, str | int]


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` sources, sorted; installed packages and the test suites left out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts[:-1]))


def load_corpus(val_percent: float = 5.0, root: Path | None = None) -> Corpus:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no .py sources under {root}: the standard library's sources are not installed")
    train, val, digest = bytearray(), bytearray(), hashlib.sha256()
    for path in files:
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        held_out = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 10_000 < val_percent * 100
        (val if held_out else train).extend(data + b"\n")
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    if not val or not train:
        raise ValueError(f"val_percent={val_percent} leaves a split empty ({len(files)} files)")
    info = {"source": f"Python {platform.python_version()} standard library", "files": len(files),
            "train_bytes": len(train), "val_bytes": len(val), "sha256": digest.hexdigest()[:16]}
    return Corpus(_tensor(train), _tensor(val), info)


def _tensor(data: bytearray) -> Tensor:
    return torch.frombuffer(data, dtype=torch.uint8).clone()


def batch(data: Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> Tensor:
    """(batch_size, seq_len + 1) int64 windows of ``data`` at random offsets: inputs and next-byte targets."""
    if data.numel() <= seq_len + 1:
        raise ValueError(f"{data.numel()} bytes cannot hold a window of {seq_len + 1}")
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    return torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()
