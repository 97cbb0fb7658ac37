"""The studies. A new study is one new file plus one line in ``STUDIES``."""

from adaattn_experiments.attention_backends import STUDY as ATTENTION_BACKENDS
from adaattn_experiments.kernels import STUDY as KERNELS

STUDIES = {
    ATTENTION_BACKENDS.name: ATTENTION_BACKENDS,
    KERNELS.name: KERNELS,
}
