"""AdaAttn, the library: adaptive attention (``attention``), Triton kernels (``kernels``), layers, the model zoo
(``models``) and its distributed training (``distributed``). It needs torch and triton, never the pipeline
(``adaattn_pipeline``) that measures it."""

__version__ = "0.1.0"
