"""AdaAttn: adaptive attention, Triton kernels, and the studies that regenerate the performance guides."""

__version__ = "0.1.0"
