"""A torch.profiler session that leaves CUPTI detached when it ends.

Kineto (the profiler's tracer) keeps CUPTI attached after a session unless the environment
variable ``TEARDOWN_CUPTI`` is "1" when the session stops (it reads it then); CUPTI's callbacks
then stay on every later CUDA launch of the process. The studies profile calls (peak memory and
kernel names, kernel time, the Triton kernels' tuning) and then time calls that are host-bound
(host time, the side-by-side rounds, the kernel manager's rankings), so without it those carry a
profiler that is no longer running (pytorch/pytorch#144455; measured: docs/notebook.md).

``profiler_session`` sets ``TEARDOWN_CUPTI=1`` where the environment does not set it. A value set
by the caller is kept (they may have a reason: torch.compile's CUDA graphs set "0"), with one
warning that later host times in the process include CUPTI's callbacks.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Sequence

TEARDOWN = "TEARDOWN_CUPTI"
_warned: set[str] = set()


def detach_cupti_after_sessions() -> bool:
    """Make sessions that stop from now on detach CUPTI (``TEARDOWN_CUPTI=1`` where unset). True where
    they will; False (and one warning per value) where the caller set another value."""
    value = os.environ.setdefault(TEARDOWN, "1")
    if value == "1":
        return True
    if value not in _warned:
        _warned.add(value)
        warnings.warn(f"{TEARDOWN}={value!r}: CUPTI stays attached after each profiler session, and host "
                      f"times taken later in this process include its callbacks; unset it or set it to '1'",
                      RuntimeWarning, stacklevel=3)
    return False


@contextlib.contextmanager
def profiler_session(activities: Sequence, **kwargs) -> Iterator:
    """``torch.profiler.profile(activities=..., **kwargs)``, detaching CUPTI when it stops."""
    from torch.profiler import profile

    detach_cupti_after_sessions()
    with profile(activities=list(activities), **kwargs) as prof:
        yield prof
