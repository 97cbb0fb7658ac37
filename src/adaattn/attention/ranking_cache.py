"""The kernel manager's rankings on disk: one JSON file, an entry per signature with the GPU, torch and
Triton versions and the measuring method it was made under. Entries of other signatures and machines stay
in the file; an entry made under other versions is not used, and the reason is kept (``load``)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

METHOD = 11  # how rankings are made (11: GPU-time rounds among the hardware's candidates); other entries are stale


def versions() -> dict[str, str | int | None]:
    """What a ranking depends on besides the signature (which names the GPU)."""
    try:
        import triton

        tri = triton.__version__
    except ImportError:
        tri = None
    return {"torch": torch.__version__, "triton": tri, "method": METHOD}


class RankingCache:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, json.JSONDecodeError) as err:
            log.warning("ignoring unreadable kernel choice cache %s: %s", self.path, err)
            return {}
        return data.get("entries", {}) if isinstance(data, dict) else {}

    def load(self) -> tuple[dict[str, list[str]], dict[str, dict[str, float]], dict[str, str]]:
        """(rankings, their times in ms, why each stale entry was not used), by signature."""
        from adaattn.attention.backends import BACKENDS

        now = versions()
        rankings, times, stale = {}, {}, {}
        for key, entry in self._read().items():
            ranking = entry.get("ranking", [])
            differs = [f"{what} {entry.get(what)} (this is {mine})" for what, mine in now.items()
                       if entry.get(what) != mine]
            if differs:
                stale[key] = "measured under " + ", ".join(differs)
            elif not ranking or any(b not in BACKENDS for b in ranking):
                stale[key] = f"unknown backend in {ranking}"
            else:
                rankings[key], times[key] = list(ranking), dict(entry.get("ms", {}))
        return rankings, times, stale

    def save(self, key: str, ranking: list[str], ms: dict[str, float]) -> None:
        """Write ``key``'s entry (the others kept), atomically: an interrupted write never leaves half a file."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        entries = self._read()
        entries[key] = {"ranking": ranking, "ms": ms, **versions(),
                        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"entries": entries}, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)
