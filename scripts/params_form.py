"""Rewrite params.yaml in the form `dvc exp run -S` writes it back, its comments kept:

    python scripts/params_form.py            # or --check: exit 1 where the file is not in that form

DVC applies `-S` overrides through Hydra and writes every list back in block style, and a comment that follows a
list is lost with it. This applies a no-op override until the file no longer changes, moving each comment block
DVC would drop into the key it introduces (as that key's first lines), where DVC keeps it. In that form an
experiment's params.yaml differs from main's in the lines it changed, and nothing else.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import yaml
from dvc.utils.hydra import apply_overrides

NOOP = "verdicts.ccgqa_mode=default"  # any key set to its value: DVC rewrites the whole file


def comment_blocks(lines: list[str]) -> list[tuple[list[str], str]]:
    """Each run of full-line comments (blank lines aside) with the line that follows it."""
    blocks, cur = [], []
    for line in lines:
        if line.strip().startswith("#"):
            cur.append(line)
        elif line.strip():
            if cur:
                blocks.append((cur, line))
            cur = []
    return blocks


def dvc_form(path: Path, rounds: int = 8) -> str:
    """The text of ``path`` in DVC's form (the file itself untouched)."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / path.name
        shutil.copy(path, work)
        for _ in range(rounds):
            before = work.read_text().splitlines()
            apply_overrides(str(work), [NOOP])
            after = work.read_text().splitlines()
            if after == before:
                return work.read_text()
            kept = "\n".join(line for line in after if line.strip())
            for block, key in comment_blocks(before):
                if "\n".join(block) in kept:
                    continue
                name = key.split("#")[0].rstrip()
                at = next(i for i, line in enumerate(after) if line.split("#")[0].rstrip() == name)
                indent = len(name) - len(name.lstrip()) + 2
                after[at + 1:at + 1] = [" " * indent + line.strip() for line in block]
                kept = "\n".join(line for line in after if line.strip())
            work.write_text("\n".join(after) + "\n")
    raise RuntimeError(f"{path}: no fixed point of DVC's rewrite in {rounds} rounds")


def main(argv: list[str]) -> int:
    path = Path("params.yaml")
    text = dvc_form(path)
    if yaml.safe_load(text) != yaml.safe_load(path.read_text()):
        raise RuntimeError("the rewrite changed a value")  # never expected: DVC's own load and dump
    if "--check" in argv:
        return 0 if text == path.read_text() else 1
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
