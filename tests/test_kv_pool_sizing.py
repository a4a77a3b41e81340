"""The CPU KV pool is sized from the memory available (issue 16, item 4) and costs nothing until used."""

from __future__ import annotations

import torch

from batchery.engine import model_runner
from batchery.engine.llm import LLM
from batchery.engine.sampling import SamplingParams


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_anonymous_zeros_are_zero_lazy_and_writable():
    before = rss_bytes()
    t = model_runner.anonymous_zeros((1 << 20, 64), torch.bfloat16)  # 128 MiB
    assert rss_bytes() - before < 16 << 20, "the pool's pages were committed at allocation"
    assert t.shape == (1 << 20, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert float(t[::4096].abs().sum()) == 0.0
    t[7, 3] = 2.5
    assert float(t[7, 3]) == 2.5 and float(t.view(-1)[: 8 * 64].sum()) == 2.5
    view = t[100:200]
    del t
    assert float(view.sum()) == 0.0  # a view keeps the mapping alive


def test_available_memory_is_positive_and_bounded():
    avail = model_runner.cpu_available_memory()
    phys = model_runner.os.sysconf("SC_PAGE_SIZE") * model_runner.os.sysconf("SC_PHYS_PAGES")
    assert 0 < avail <= phys


def test_default_cpu_pool_follows_available_memory(tiny_model_dir):
    avail = model_runner.cpu_available_memory()
    before = rss_bytes()
    llm = LLM(str(tiny_model_dir), dtype="float32", max_num_seqs=4096, max_model_len=512)
    runner = llm.engine.runner
    want = max(int(avail * model_runner.CPU_KV_FRACTION), model_runner.MIN_CPU_KV_BYTES)
    cap = 4096 * (512 // runner.block_size)  # every slot filled to the full context
    expected = min(want // runner._bytes_per_block(), cap)
    # the available memory moves a little between the two readings
    assert abs(runner.num_kv_blocks - expected) <= max(expected // 20, 1)
    # the pool is not committed up front: building the engine grew RSS by far less than the pool
    assert rss_bytes() - before < runner.kv_cache_bytes() // 4 + (64 << 20)
    # and it works: greedy generation over it gives the same tokens as over a small, eagerly zeroed pool
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in llm.generate([[1, 2, 3, 4, 5], [9, 8, 7]], params)]
    small = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, max_model_len=512)
    assert got == [o.token_ids for o in small.generate([[1, 2, 3, 4, 5], [9, 8, 7]], params)]
