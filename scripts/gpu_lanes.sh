#!/usr/bin/env bash
# Measure several single-GPU stages at once on a machine of several GPUs (docs/gpu-box.md): one lane a GPU and
# an equal share of the cores (taskset: each lane's process and its compile workers stay on its own cores, as on
# a one-GPU machine), a lane's studies one after another, each stopped at the deadline so that the call ends in
# time (a stopped study writes nothing: its committed results stay). One quoted list of studies a lane:
#
#   DEADLINE_S=540 LOGS=$OUT/logs bash scripts/gpu_lanes.sh h100 "kernels precision" "rank" "scaling ccgqa"
#
# Each study runs `adaattn run <study> --target <target>`, the command of its DVC stage; lanes.txt says how each
# ended and how long it took. SLOTS=4 with three lanes leaves the last GPU and its share of the cores to other work.
#
# A study whose peer packages are not importable (the wheels docs/gpu-box.md lists, not carried) is not started:
# its run would replace a complete results file with rows that say `unavailable`. ALLOW_MISSING_PEERS=1 runs it.
set -u
declare -A peers=([kernels]="liger_kernel" [mfu]="torchao torchtitan liger_kernel" [train]="torchao"
                  [precision]="sageattention")
missing_peers() {
  local m
  for m in ${peers[$1]:-}; do
    python3 -c "import $m" >/dev/null 2>&1 || echo -n "$m "
  done
}
target=$1
shift
end=$(($(date +%s) + ${DEADLINE_S:-540}))
logs=${LOGS:-logs}
mkdir -p "$logs"
per=$(($(nproc) / ${SLOTS:-$#}))
gpu=0
for lane in "$@"; do
  (
    for study in $lane; do
      left=$((end - $(date +%s)))
      if [ "$left" -lt 30 ]; then
        echo "$study: not started (deadline)" >>"$logs/lanes.txt"
        continue
      fi
      missing=$(missing_peers "$study")
      if [ -n "$missing" ] && [ "${ALLOW_MISSING_PEERS:-0}" != 1 ]; then
        echo "$study: not started (peers not importable: $missing)" >>"$logs/lanes.txt"
        continue
      fi
      start=$(date +%s)
      CUDA_VISIBLE_DEVICES=$gpu taskset -c $((gpu * per))-$((gpu * per + per - 1)) \
        timeout "$left" adaattn run "$study" --target "$target" >"$logs/$study.log" 2>&1
      echo "$study: exit $? after $(($(date +%s) - start)) s on GPU $gpu" >>"$logs/lanes.txt"
    done
  ) &
  gpu=$((gpu + 1))
done
wait
cat "$logs/lanes.txt"
if [ -n "${OUT:-}" ] && [ -n "${TORCHINDUCTOR_CACHE_DIR:-}" ]; then
  bash scripts/gpu_cache.sh save  # the lanes' compile caches, for the next call to carry
fi
