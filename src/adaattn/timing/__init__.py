"""What the library times with: timers, calls side by side in shuffled rounds, a call's peak memory and
kernels, and a profiler session. The kernel manager ranks backends and the kernels tune their launches
with these; the pipeline's harness builds on the same pieces."""
