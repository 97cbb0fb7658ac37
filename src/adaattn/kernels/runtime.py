"""When the Triton kernels run, and what every kernel launcher shares.

The switches (G4-C1): ``get_kernel_status()``, ``set_use_triton_kernels(bool)`` and the environment
variable ``ADAATTN_DISABLE_TRITON=1``. With the kernels off, without Triton, or for tensors on a
device the kernels cannot run on, the same public functions run the PyTorch references. On a CPU
machine the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI
tests them; it checks correctness, never speed.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

ENV_DISABLE = "ADAATTN_DISABLE_TRITON"
KERNELS = ("rms_norm", "swiglu", "rope", "qk_norm_rope")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_use_triton: bool = True  # set_use_triton_kernels; the environment variable overrides it


def interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _triton() -> tuple[str | None, str | None]:
    """(version, None) when Triton imports, else (None, why not)."""
    try:
        import triton
    except Exception as err:  # noqa: BLE001 - the import error is the reason
        return None, f"triton not importable: {type(err).__name__}: {err}"
    return triton.__version__, None


def set_use_triton_kernels(enabled: bool) -> None:
    """Turn the Triton kernels on or off for this process (new calls and new compilations)."""
    global _use_triton
    if not isinstance(enabled, bool):
        raise TypeError(f"set_use_triton_kernels takes True or False; got {enabled!r}")
    _use_triton = enabled


def _disabled_by_env() -> bool:
    return os.environ.get(ENV_DISABLE, "0").strip().lower() not in ("", "0", "false", "no")


def _why_off() -> str | None:
    version, why = _triton()
    if version is None:
        return why
    if _disabled_by_env():
        return f"disabled by {ENV_DISABLE}={os.environ[ENV_DISABLE]}"
    if not _use_triton:
        return "disabled by set_use_triton_kernels(False)"
    if not torch.cuda.is_available() and not interpreter():
        return "no CUDA device (and TRITON_INTERPRET is not set): PyTorch references run instead"
    return None


def get_kernel_status() -> dict[str, Any]:
    """Whether the Triton kernels run here, and if not, why."""
    version, _ = _triton()
    why = _why_off()
    return {
        "triton_available": version is not None,
        "triton_version": version,
        "use_triton_kernels": why is None,
        "reason": why or "",
        "interpreter": interpreter(),
        "cuda_available": torch.cuda.is_available(),
        "env_var": ENV_DISABLE,
        "kernels": list(KERNELS),
    }


@torch.compiler.assume_constant_result
def kernels_on() -> bool:
    """Read once per compilation under torch.compile (a constant of the graph), every call in eager."""
    return _why_off() is None


def use_triton(*tensors: Tensor) -> bool:
    """True when the kernels are on and can run on these tensors' device."""
    if not kernels_on():
        return False
    devices = {t.device.type for t in tensors}
    return devices == {"cuda"} or (devices == {"cpu"} and interpreter())


def check_float(name: str, t: Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16; got {t.dtype}")


def last_dim_contiguous(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def rows(t: Tensor) -> Tensor:
    """(..., N) -> (M, N) without a copy when rows are evenly strided and the last dim is contiguous."""
    t2 = last_dim_contiguous(t).reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def flat_rows(t: Tensor) -> tuple[Tensor, int]:
    """(t as (M, N) rows, row stride) with the fewest host ops: a contiguous t as it is (its rows are
    N apart; no reshape or view, each a few us of host time), otherwise ``rows(t)``."""
    if t.is_contiguous():
        return t, t.shape[-1]
    t2 = rows(t)
    return t2, t2.stride(0)


@functools.cache
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programs_for(n: int, device: torch.device, per_sm: int = 4) -> int:
    """Persistent-style grid for kernels that accumulate per program: ``per_sm`` per SM (8 in the
    interpreter), at most n."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(n, per_sm * sm_count(index)))
    return max(1, min(n, 8))


def tuned(configs: list) -> list:
    """Autotune configs; the interpreter gets the first only (it checks correctness, never speed)."""
    return configs[:1] if interpreter() else configs


def bench_for_autotune(kernel_call, quantiles):
    """Autotuning on a short budget: every config of every new hidden size is timed once per process."""
    import triton.testing

    return triton.testing.do_bench(kernel_call, warmup=5, rep=20, quantiles=quantiles)


class TunedLaunch:
    """Launch an autotuned kernel with its tuned config looked up once per key.

    Triton's ``Autotuner.run`` rebuilds its key from every argument on every call: 22 us of host
    time on the H100 host (Triton 3.6), as much as the launch itself, for kernels that run in a few
    us. The launcher passes its own key instead (the values the autotuner is keyed on plus the
    dtypes, as the autotuner keys them). The first call of a key goes through the autotuner, which
    tunes and runs; later calls launch the JIT function with the config it chose, so the kernel and
    its config are the same either way.
    """

    def __init__(self, kernel: Any):
        self.kernel = kernel
        self.jit = kernel.fn
        self.chosen: dict[tuple, dict[str, Any]] = {}

    def __call__(self, key: tuple, grid: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Launch; returns the config's meta-parameters it ran with (for grids that depend on them)."""
        meta = self.chosen.get(key)
        if meta is None:
            self.kernel[grid](*args, **kwargs)
            best = self.kernel.best_config
            if best.pre_hook is None:
                self.chosen[key] = best.all_kwargs()
            return best.all_kwargs()
        self.jit[grid(meta) if callable(grid) else grid](*args, **kwargs, **meta)
        return meta
