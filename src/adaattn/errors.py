"""Exceptions shared by the library and the pipeline, and how a failed call is recorded."""

from __future__ import annotations


class Unsupported(RuntimeError):
    """This case cannot run on this provider/device (dtype, head dim, missing backward...).

    The harness records it as a row with status ``unsupported`` and the message as the reason.
    """


class ConfigError(ValueError):
    """A config (params.yaml, a CLI override or argument) is invalid; the message names the key and the allowed
    values, and it is raised before any work starts."""


def classify_error(err: BaseException) -> tuple[str, str]:
    """(status, reason) for an exception raised while running a case: a row's status says what kind of failure."""
    import torch  # here: the config checks that import this module need no torch

    text = " ".join(str(err).split())[:400]
    if isinstance(err, torch.OutOfMemoryError):
        return "oom", f"out of memory: {text[:200]}"
    if isinstance(err, (NotImplementedError, Unsupported)):
        return "unsupported", text
    return "error", f"{type(err).__name__}: {text}"
