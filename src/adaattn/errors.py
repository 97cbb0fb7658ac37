"""Exceptions shared by the library and the harness."""


class Unsupported(RuntimeError):
    """This case cannot run on this provider/device (dtype, head dim, missing backward...).

    The harness records it as a row with status ``unsupported`` and the message as the reason.
    """
