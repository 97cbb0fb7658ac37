"""The studies. A new study is one new file plus one line in ``STUDIES``."""

from adaattn_experiments.allocator import STUDY as ALLOCATOR
from adaattn_experiments.attention_backends import STUDY as ATTENTION_BACKENDS
from adaattn_experiments.ccgqa import STUDY as CCGQA
from adaattn_experiments.checkpointing import STUDY as CHECKPOINTING
from adaattn_experiments.cpu_baseline import STUDY as CPU_BASELINE
from adaattn_experiments.distributed import STUDY as DISTRIBUTED
from adaattn_experiments.inference import STUDY as INFERENCE
from adaattn_experiments.kernels import STUDY as KERNELS
from adaattn_experiments.memory_analysis import STUDY as MEMORY_ANALYSIS
from adaattn_experiments.memory_bank import STUDY as MEMORY_BANK
from adaattn_experiments.mfu import STUDY as MFU
from adaattn_experiments.precision import STUDY as PRECISION
from adaattn_experiments.rank import STUDY as RANK
from adaattn_experiments.scaling import STUDY as SCALING
from adaattn_experiments.train import STUDY as TRAIN
from adaattn_experiments.training import STUDY as TRAINING

STUDIES = {
    ATTENTION_BACKENDS.name: ATTENTION_BACKENDS,
    KERNELS.name: KERNELS,
    PRECISION.name: PRECISION,
    RANK.name: RANK,
    SCALING.name: SCALING,
    CPU_BASELINE.name: CPU_BASELINE,
    TRAINING.name: TRAINING,
    CHECKPOINTING.name: CHECKPOINTING,
    TRAIN.name: TRAIN,
    CCGQA.name: CCGQA,
    MFU.name: MFU,
    ALLOCATOR.name: ALLOCATOR,
    INFERENCE.name: INFERENCE,
    MEMORY_ANALYSIS.name: MEMORY_ANALYSIS,
    MEMORY_BANK.name: MEMORY_BANK,
    DISTRIBUTED.name: DISTRIBUTED,
}
