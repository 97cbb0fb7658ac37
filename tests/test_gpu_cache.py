"""scripts/gpu_cache.sh: the compile caches a GPU call carries in (restore) and brings back (save), capped."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_cache.sh"


def _bash(cmd: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True)


def test_restore_makes_the_carried_caches_the_compile_caches(tmp_path):
    (tmp_path / ".gpu-cache" / "triton" / "ab").mkdir(parents=True)
    (tmp_path / ".gpu-cache" / "triton" / "ab" / "kernel.cubin").write_bytes(b"x")
    root = tmp_path / "root"
    done = _bash(f". {SCRIPT} restore && echo $TORCHINDUCTOR_CACHE_DIR $TRITON_CACHE_DIR && echo $-", tmp_path,
                 GPU_CACHE_ROOT=str(root))
    inductor, triton, flags = done.stdout.split()
    assert done.returncode == 0 and (inductor, triton) == (f"{root}/inductor", f"{root}/triton")
    assert (root / "triton" / "ab" / "kernel.cubin").read_bytes() == b"x"
    assert "u" not in flags and "e" not in flags  # sourced: no shell option left set in the caller


def test_restore_unpacks_the_archive_save_wrote(tmp_path):
    """The compressed form is what a call carries beside the wheels: what ``save`` wrote, restored as it was."""
    root, out = tmp_path / "root", tmp_path / "out"
    (root / "inductor" / "fx").mkdir(parents=True)
    (root / "inductor" / "fx" / "graph").write_bytes(b"compiled")
    out.mkdir()
    saved = _bash(f"bash {SCRIPT} save", tmp_path, GPU_CACHE_ROOT=str(root), OUT=str(out))
    assert saved.returncode == 0, saved.stderr
    call = tmp_path / "call"
    call.mkdir()
    (out / "gpu-cache.tgz").rename(call / ".gpu-cache.tgz")
    fresh = tmp_path / "fresh"
    done = _bash(f". {SCRIPT} restore && echo $TORCHINDUCTOR_CACHE_DIR", call, GPU_CACHE_ROOT=str(fresh))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"{fresh}/inductor"]
    assert (fresh / "inductor" / "fx" / "graph").read_bytes() == b"compiled"


def test_save_keeps_the_newest_entries_under_the_cap_whole(tmp_path):
    """A cache entry is a folder (a Triton kernel's cubin, its json and the rest): kept whole, newest first, or
    not at all; a kernel kept without its cubin fails every later load of it."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    for i, name in enumerate(("old", "mid", "new")):
        entry = root / "triton" / name
        entry.mkdir(parents=True)
        for part in ("k.cubin", "k.json"):
            f = entry / part
            f.write_bytes(os.urandom(2**19))
            os.utime(f, (1_000_000 + i, 1_000_000 + i))
    os.utime(root / "triton" / "old" / "k.json", (2_000_000, 2_000_000))  # its json the newest file of all
    done = _bash(f"bash {SCRIPT} save", tmp_path, GPU_CACHE_ROOT=str(root), OUT=str(out), GPU_CACHE_MB="2.5")
    assert done.returncode == 0, done.stderr
    with tarfile.open(out / "gpu-cache.tgz") as tar:
        assert sorted(tar.getnames()) == ["triton/new/k.cubin", "triton/new/k.json", "triton/old/k.cubin",
                                          "triton/old/k.json"]
    assert "4 of 6 files" in done.stdout


def test_restore_drops_a_kernel_missing_a_file_its_group_names(tmp_path):
    """Caches saved file by file (before whole entries) may hold a kernel without its cubin: restore removes it,
    so Triton compiles it again instead of failing to load it."""
    import json

    cache = tmp_path / ".gpu-cache" / "triton"
    for name, parts in (("whole", ("k.cubin", "k.json")), ("broken", ("k.json",))):
        (cache / name).mkdir(parents=True)
        for part in parts:
            (cache / name / part).write_bytes(b"x")
        (cache / name / "__grp__k.json").write_text(json.dumps(
            {"child_paths": {p: f"/elsewhere/{name}/{p}" for p in ("k.cubin", "k.json")}}))
    root = tmp_path / "root"
    done = _bash(f". {SCRIPT} restore", tmp_path, GPU_CACHE_ROOT=str(root))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (root / "triton").iterdir()) == ["whole"]
