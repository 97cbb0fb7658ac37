#!/usr/bin/env bash
# Inductor's and Triton's compile caches kept from one GPU call to the next (each call starts on a bare machine,
# so every call compiles cold and `max-autotune` does not fit in one; docs/gpu-box.md):
#
#   . scripts/gpu_cache.sh restore   # start of a call: the carried .gpu-cache.tgz and/or .gpu-cache/ (if any)
#                                    # become the caches
#   bash scripts/gpu_cache.sh save   # end of a call: the caches as $OUT/gpu-cache.tgz, newest files first, at
#                                    # most GPU_CACHE_MB (50) before compression
#
# Back here: `cp <files_at>/gpu-cache.tgz .gpu-cache.tgz`, and the next call carries ".gpu-cache.tgz": compressed
# (50 MiB of caches are ~8 MiB) it fits beside the wheels (.whl) in what a call may carry (64 MiB with the working
# tree), where the unpacked folder did not. Both caches key their entries by source, versions and device, so a
# stale entry is a miss, never a wrong kernel. `restore` exports TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR
# (source it; it sets no shell options in the caller).
_root=${GPU_CACHE_ROOT:-/tmp/gpu-cache}
case "${1:-}" in
  restore)
    mkdir -p "$_root/inductor" "$_root/triton"
    if [ -f .gpu-cache.tgz ]; then
      tar xzf .gpu-cache.tgz -C "$_root"
    fi
    if [ -d .gpu-cache ]; then
      cp -r .gpu-cache/. "$_root/"
    fi
    # a Triton kernel whose folder lacks a file its group json names (caches saved file by file, before whole
    # entries) is removed: Triton would fail to load it rather than compile it again
    python3 - "$_root/triton" <<'EOF'
import json, shutil, sys
from pathlib import Path

for grp in list(Path(sys.argv[1]).rglob("__grp__*.json")):
    if grp.exists() and any(not (grp.parent / k).exists() for k in json.loads(grp.read_text())["child_paths"]):
        shutil.rmtree(grp.parent)
EOF
    export TORCHINDUCTOR_CACHE_DIR="$_root/inductor" TRITON_CACHE_DIR="$_root/triton"
    ;;
  save)
    : "${OUT:?save writes \$OUT/gpu-cache.tgz: OUT must name the output folder of the call}"
    python3 - "$_root" "${GPU_CACHE_MB:-50}" "$OUT/gpu-cache.tgz" <<'EOF'
import sys, tarfile
from pathlib import Path

root, cap, out = Path(sys.argv[1]), float(sys.argv[2]) * 2**20, sys.argv[3]
# whole entries or none: a Triton kernel is a folder of files (its group json names the cubin and the rest), and
# one kept without its cubin fails every later load of that kernel ("Unknown key: 'cubin'")
entries: dict[Path, list[Path]] = {}
for p in root.rglob("*"):
    if p.is_file():
        entries.setdefault(p.parent, []).append(p)
newest = sorted(entries.values(), key=lambda fs: max(f.stat().st_mtime for f in fs), reverse=True)
kept, total, files = [], 0, sum(len(fs) for fs in newest)
for fs in newest:  # newest first: what this call compiled or used
    size = sum(f.stat().st_size for f in fs)
    if total + size <= cap:
        kept += fs
        total += size
with tarfile.open(out, "w:gz") as tar:
    for p in kept:
        tar.add(p, arcname=str(p.relative_to(root)))
print(f"gpu-cache: {len(kept)} of {files} files, {total / 2**20:.1f} MiB (cap {cap / 2**20:.0f}) -> {out}")
EOF
    ;;
  *)
    echo "usage: . scripts/gpu_cache.sh restore | bash scripts/gpu_cache.sh save (allowed: restore, save)" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac
