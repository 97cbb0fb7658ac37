"""The Nyström forward's r x r solve past the fused one (``kernels.nystrom``, step 3): the same maths as
``_landmark_solve`` as batched fp32 matmuls over all heads, captured once per kind of call as a CUDA graph
and replayed (its ~35 launches' issue cost more host time than the GPU took; ``kernels.nystrom``'s docstring
has the timings)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch
from torch import Tensor

from adaattn.kernels.pinv import pinv
from adaattn.kernels.runtime import interpreter

log = logging.getLogger(__name__)


def _solve_batched(ws: Tensor, *, B: int, Hq: int, Hkv: int, rank: int, D: int, splits: int, off_kl: int, off_m: int,
                   off_acc: int, off_w: int, scale: float, pinv_iters: int) -> None:
    """W = pinv(softmax(Q~ K~^T)) (b v) into WS[off_w:], for ranks past the fused solve: the same
    maths as ``_landmark_solve`` (merge the key splits, the landmark kernel, Newton-Schulz) as
    batched fp32 matmuls over all heads (the r x r iterates no longer fit one program)."""
    n_rows = Hq // Hkv * rank
    n_part = B * Hkv * splits * n_rows
    ql = ws[:B * Hq * rank * D].view(B, Hkv, n_rows, D)  # a kv head's query heads' landmarks, stacked
    kl = ws[off_kl:off_kl + B * Hkv * rank * D].view(B, Hkv, rank, D)
    m = ws[off_m:off_m + n_part].view(B, Hkv, splits, n_rows)  # row max per split, log2 units
    l_part = ws[off_m + n_part:off_m + 2 * n_part].view(B, Hkv, splits, n_rows)
    acc = ws[off_acc:off_acc + n_part * D].view(B, Hkv, splits, n_rows, D)
    weight = torch.exp2(m - m.amax(2, keepdim=True))
    bv = (acc * weight[..., None]).sum(2) / (l_part * weight).sum(2)[..., None]
    a = torch.softmax(ql @ kl.transpose(-2, -1) * scale, dim=-1)  # (B, Hkv, g r, r)
    a, bv = a.view(B * Hq, rank, rank), bv.view(B * Hq, rank, D)
    torch.bmm(pinv(a, pinv_iters), bv, out=ws[off_w:off_w + B * Hq * rank * D].view(B * Hq, rank, D))


class _SolveGraph:
    """The batched solve of one kind of call (shapes, workspace layout, scale, iterations; the device,
    the current stream, the fp32 matmul settings), captured once as a CUDA graph over a workspace that then
    persists: each call's kernels fill it, the graph replays the solve in it. Calls on one stream
    run in order, so they can share it (``_SOLVE_LOCK``: two threads' launches do not interleave);
    another stream gets its own. Up to ``MAX_SOLVE_GRAPHS``
    are kept, the least recently used dropped first (each holds its workspace and the solve's
    intermediates: a few r x r fp32 matrices per head). None, and the solve runs launch by launch on a
    fresh workspace, off CUDA, in the interpreter, while the caller's stream is being captured
    (the launches then join the caller's graph) or where capture failed (logged once)."""

    __slots__ = ("ws", "graph", "stream")

    def __init__(self, ws: Tensor, graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream):
        self.ws, self.graph, self.stream = ws, graph, stream

    @staticmethod
    def get(kind: tuple, numel: int, device: torch.device, solve) -> _SolveGraph | None:
        if device.type != "cuda" or interpreter() or not GRAPH_SOLVE or torch.cuda.is_current_stream_capturing():
            return None
        key = (*kind, device, torch.cuda.current_stream(device).cuda_stream, torch.get_float32_matmul_precision(),
               getattr(torch.backends.cuda.matmul, "fp32_precision", None))
        entry = _SOLVE_GRAPHS.get(key)
        if entry is not None:
            _SOLVE_GRAPHS.move_to_end(key)
            return entry
        if key in _SOLVE_UNGRAPHED:
            return None
        try:
            entry = _SolveGraph._capture(numel, device, solve)
        except RuntimeError as err:  # the launches still run, one by one
            _SOLVE_UNGRAPHED.add(key)
            log.warning("Nyström batched solve not captured as a CUDA graph (%s: %s); it runs launch by launch",
                        type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            return None
        if len(_SOLVE_GRAPHS) >= MAX_SOLVE_GRAPHS:
            _SOLVE_GRAPHS.popitem(last=False)[1].stream.synchronize()  # its replays done before its memory goes
        _SOLVE_GRAPHS[key] = entry
        return entry

    @staticmethod
    def _capture(numel: int, device: torch.device, solve) -> _SolveGraph:
        with torch.cuda.device(device):
            ws = torch.zeros(numel, device=device, dtype=torch.float32)  # finite: the warm-up and capture read it
            here, side = torch.cuda.current_stream(), torch.cuda.Stream()
            side.wait_stream(here)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                solve(ws)  # warm-up outside the capture (cuBLAS handles, workspaces)
                graph.capture_begin(capture_error_mode="thread_local")  # other threads' CUDA calls go on
                try:
                    solve(ws)
                finally:
                    graph.capture_end()
            here.wait_stream(side)
        return _SolveGraph(ws, graph, here)


GRAPH_SOLVE = True  # capture the batched solve as a CUDA graph (False: every call launches it op by op)
MAX_SOLVE_GRAPHS = 8
_SOLVE_GRAPHS: OrderedDict[tuple, _SolveGraph] = OrderedDict()
_SOLVE_UNGRAPHED: set[tuple] = set()  # kinds whose capture failed
_SOLVE_LOCK = threading.Lock()  # held while a batched-solve call issues its launches
