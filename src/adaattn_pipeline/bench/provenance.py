"""Where a number came from: hardware, software, code version, params hash, time."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

# Paths whose state decides what a study measures; "dirty" means one of them has uncommitted edits.
CODE_PATHS = ("src", "experiments", "params.yaml", "pyproject.toml")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_state() -> tuple[str, bool | None]:
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return "unknown", None
    status = _git("status", "--porcelain", "--", *CODE_PATHS)
    return commit, (bool(status) if status is not None else None)


def nvidia_driver() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return str(pynvml.nvmlSystemGetDriverVersion())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML: try nvidia-smi, else unknown
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
        except (OSError, subprocess.TimeoutExpired, IndexError):
            return ""


# The peer libraries the studies measure beside ours: their versions decide the peers' rows.
PEERS = ("liger-kernel", "torchao", "xformers", "flash-attn")


def peer_versions() -> str:
    """``name version`` of each peer installed, ``name -`` of each not (read from package metadata, not imported)."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "-"

    return "; ".join(f"{name} {version(name)}" for name in PEERS)


def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception as err:  # noqa: BLE001
        return f"unavailable ({type(err).__name__})"


def hardware(device: str) -> dict[str, object]:
    if device == "cuda":
        return {
            "hardware": torch.cuda.get_device_name(0),
            "hardware_count": torch.cuda.device_count(),
            "driver": nvidia_driver(),
            "cuda": torch.version.cuda or "",
            "cudnn": str(torch.backends.cudnn.version() or ""),
        }
    return {
        "hardware": cpu_model(),
        "hardware_count": os.cpu_count() or 0,
        "driver": "",
        "cuda": "",
        "cudnn": "",
    }


def provenance(device: str, target: str, params_hash: str, code_hash: str) -> dict[str, object]:
    """Where a result came from; ``code_hash``: the hash of the code and data its study reaches
    (``codegraph.study_code_hash``), what its report compares with today's."""
    commit, dirty = git_state()
    return {
        "target": target,
        **hardware(device),
        "host": cpu_model(),  # a GPU run's host time moves with its CPU, which differs between lent machines
        "torch": torch.__version__,
        "triton": triton_version(),
        "python": platform.python_version(),
        "peers": peer_versions(),
        "git_commit": commit,
        "git_dirty": dirty,
        "code_hash": code_hash,
        "params_hash": params_hash,
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["adaattn", *sys.argv[1:]]),
    }


PROVENANCE_COLUMNS = (
    "target", "hardware", "hardware_count", "host", "driver", "cuda", "cudnn", "torch", "triton", "python", "peers",
    "git_commit", "git_dirty", "code_hash", "params_hash", "measured_at", "command",
)
