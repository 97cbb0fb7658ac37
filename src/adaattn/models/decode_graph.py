"""``decode_next`` captured once into a CUDA graph the host replays a token: the README's fast ``generate`` step.

A step compiled with ``reduce-overhead`` is replayed by CUDA-graph trees behind dynamo's guards, and that host work
(guards over every parameter and buffer, the trees' input and pool checks) is paid on every call, near enough a
small model's step to leave the GPU idle between tokens. Here inductor compiles the step without its own graphs and
the step is captured once into a ``torch.cuda.CUDAGraph`` (as vLLM and SGLang capture theirs): a token costs the
host one ``replay()``. ``decode_next`` reads and writes buffers only (``model.decode_state``, the caches), whose addresses
``setup_kv_cache`` fixes, so the captured graph serves every position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from adaattn.models.generate import decode_next

WARM_STEPS = 2  # real steps run (compiled, not captured) before the capture: compiles, autotuning, cuBLAS's workspace


class GraphedStep:
    """A ``generate(..., step=...)`` step: ``decode_next`` compiled by inductor (``mode``, default ``"default"``;
    one with CUDA graphs of its own is refused) and, on a GPU, captured into one CUDA graph.

    The first ``WARM_STEPS`` calls are real steps through the compiled function on a side stream; the next captures
    the graph and replays it, and every call after only replays it. The graph holds ``temperature`` and
    ``eos_token`` and the addresses of the model's buffers: a call with other values, another model, or after
    ``setup_kv_cache`` made new caches, captures again (``captures`` counts them); it holds the model and its
    ``decode_state`` until then. Weights moved or replaced after a capture (``.to``, quantizing) are not seen:
    make a new ``GraphedStep`` then (``load_state_dict`` copies in place and is safe). Without CUDA the compiled
    function runs as it is (no graph)."""

    def __init__(self, mode: str = "default", step: Callable[..., None] = decode_next):
        if mode in ("reduce-overhead", "max-autotune"):
            raise ValueError(f"mode={mode!r}: GraphedStep captures its own CUDA graph; allowed: 'default', "
                             "'max-autotune-no-cudagraphs'")
        self.compiled = torch.compile(step, mode=mode, fullgraph=True)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0
        # the model and state themselves, not their ids: after clear_kv_cache a new state can take a freed one's id
        self._for: tuple | None = None
        self._warm = 0

    def __call__(self, model: nn.Module, temperature: float = 0.0, eos_token: int | None = None) -> None:
        state = model.decode_state
        if state is None:
            raise ValueError("no decode state: call setup_kv_cache(model, batch, max_seq_len) first")
        if not state.out.is_cuda:
            self.compiled(model, temperature, eos_token)
            return
        if self._for is None or self._for[0] is not model or self._for[1] is not state \
                or self._for[2:] != (temperature, eos_token):  # other buffers or constants: warm up, capture again
            self.graph, self._for, self._warm = None, (model, state, temperature, eos_token), 0
        if self.graph is not None:
            self.graph.replay()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            if self._warm < WARM_STEPS:  # a real step
                self._warm += 1
                self.compiled(model, temperature, eos_token)
            else:  # capture (nothing runs), then replay: this call's step; kept only once captured whole
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=side):
                    self.compiled(model, temperature, eos_token)
                self.graph = graph
                self.captures += 1
        torch.cuda.current_stream().wait_stream(side)
        if self.graph is not None:
            self.graph.replay()
