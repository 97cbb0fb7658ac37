"""Guide 003's serving helpers on the CPU: the batch-size search against a fake out-of-memory limit (doubling,
then bisection; memory errors recovered, others raised; the answer cached), the throughput tracker on a fake
clock."""

from __future__ import annotations

import pytest
import torch

from adaattn.models.serving import ThroughputTracker, find_optimal_batch_size


def _limited(limit: int, calls: list[int]):
    def run(batch: int) -> None:
        calls.append(batch)
        if batch > limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    return run


@pytest.mark.parametrize("limit, max_batch, want", [(37, 1024, 37), (1, 64, 1), (500, 100, 100), (64, 64, 64)])
def test_the_search_finds_the_largest_batch_that_runs(limit, max_batch, want):
    calls: list[int] = []
    assert find_optimal_batch_size(_limited(limit, calls), max_batch, device="cpu") == want
    assert max(b for b in calls if b <= limit) == want and len(calls) <= 2 * max_batch.bit_length() + 1


def test_the_answer_is_cached_by_key(tmp_path):
    cache, calls = tmp_path / "batch.json", []
    assert find_optimal_batch_size(_limited(20, calls), 256, device="cpu", cache=cache, key="ltm s2048 H100") == 20
    n = len(calls)
    assert find_optimal_batch_size(_limited(20, calls), 256, device="cpu", cache=cache, key="ltm s2048 H100") == 20
    assert len(calls) == n  # nothing ran
    assert find_optimal_batch_size(_limited(9, calls), 256, device="cpu", cache=cache, key="other") == 9


def test_what_is_not_out_of_memory_is_raised():
    def broken(batch: int) -> None:
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        find_optimal_batch_size(broken, 8, device="cpu")
    with pytest.raises(RuntimeError, match="batch 4 runs out of memory"):
        find_optimal_batch_size(_limited(2, []), 8, start=4, device="cpu")
    with pytest.raises(ValueError, match="cache and key go together"):
        find_optimal_batch_size(_limited(2, []), 8, device="cpu", key="x")


def test_the_tracker_counts_tokens_over_time():
    ticks = iter([0.0, 1.0, 2.0, 4.0])
    with ThroughputTracker(3, clock=lambda: next(ticks), show=False) as t:
        t.update(100)
        t.update(100)
        t.update(200)
    assert t.tokens == 400 and t.tokens_per_s == pytest.approx(100.0)



@torch.no_grad()
def test_the_batch_processor_serves_each_prompt_as_generate_would_alone():
    """Prompts of two lengths, more than a batch of one length: grouped by length, at most max_batch a batch, and
    every sequence the one greedy generation gives that prompt by itself, in the order given."""
    from adaattn.models.config import ModelConfig
    from adaattn.models.transformer import Transformer
    from adaattn.models.generate import clear_kv_cache, generate, setup_kv_cache
    from adaattn.models.serving import BatchProcessor

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=2, max_seq_len=32, mlp="gelu",
                                    norm="layernorm", positions="learned")).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 50, (n,), generator=g) for n in (5, 7, 5, 5, 7)]
    serve = BatchProcessor(model, max_batch=2, new_tokens=4, show=False)
    assert serve.batches(prompts) == [[1, 4], [0, 2], [3]]  # the longest first
    out = serve.run(prompts)
    for prompt, seq in zip(prompts, out):
        setup_kv_cache(model, 1, prompt.numel() + 4)
        alone = generate(model, prompt[None], 4)[0]
        clear_kv_cache(model)
        assert torch.equal(seq, alone)
    assert [(s["batch"], s["prompt_len"]) for s in serve.stats] == [(2, 7), (2, 5), (1, 5)]
    from adaattn.models.generate import decode_next  # generate's fast path serves the same sequences

    assert all(torch.equal(a, b) for a, b in zip(BatchProcessor(model, 2, 4, show=False, step=decode_next).run(prompts),
                                                 out, strict=True))
    assert all(s["tokens_per_s"] > 0 and s["peak_mb"] is None for s in serve.stats)  # no allocator on a CPU
    with pytest.raises(ValueError, match="prompt 0: a non-empty 1-D tensor"):
        serve.batches([torch.zeros(2, 3, dtype=torch.long)])
    with pytest.raises(ValueError, match="max_batch=0"):
        BatchProcessor(model, max_batch=0, new_tokens=4)
