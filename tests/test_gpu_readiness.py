"""The GPU path's memory and host-copy structure (issue 17), checked on the CPU.

The decode CUDA graphs cannot be captured here, so what the capture depends on is kept testable
without it: the logits buffer's size is a pure function, the static-buffer path runs with
``capture=False`` (the graphs' inputs and outputs, the same code as on CUDA), and a dropped engine
is checked to free its KV pool without a GC pass.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import gc  # noqa: E402
import weakref  # noqa: E402

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _interpreter_scalar_index(monkeypatch):
    """triton-lang/triton#9171 in the CPU interpreter (see tests/test_triton_kernels.py)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)


def _config(tiny_model_dir, **kw):
    from batchery.engine.config import EngineConfig

    base = dict(
        model=str(tiny_model_dir),
        dtype="float32",
        device=DEVICE,
        block_size=4,
        max_num_seqs=6,
        attention_backend="triton",
    )
    base.update(kw)
    return EngineConfig(**base)


def test_shared_logits_buffer_bytes():
    """One logits buffer for all graphs: at 512 sequences and SmolLM2's 49152-token vocabulary in
    bf16, the graphs kept 0.83 GB of logits (the sum of the bucket sizes x vocab); now the size of
    the largest bucket's, 50 MB."""
    from batchery.engine.cuda_graphs import bucket_sizes, logits_bytes

    sizes = bucket_sizes(512)
    assert sum(sizes) == 8463
    before = logits_bytes(sizes, 49152, 2, shared=False)
    after = logits_bytes(sizes, 49152, 2)
    assert before == 8463 * 49152 * 2 == 831_946_752
    assert after == 512 * 49152 * 2 == 50_331_648
    assert logits_bytes(bucket_sizes(512), 128256, 2, shared=False) > 2.1e9  # a 128k vocabulary


def test_decode_graphs_share_one_logits_buffer(tiny_model_dir):
    """Every bucket's logits are rows of one [max_size, vocab] buffer: the batch shrinks through
    the buckets 4 -> 2 -> 1 and every step's logits start at the buffer's first row."""
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.loader import load_model
    from batchery.engine.sampling import SamplingParams

    config = _config(tiny_model_dir)
    eng = LLMEngine(config, loaded=load_model(config))
    graphs = eng.runner.build_decode_graphs(capture=False)
    eng.runner.graphs = graphs
    seen: list[tuple[int, int]] = []
    run = graphs.run

    def watched(p):
        out = run(p)
        seen.append((out.shape[0], out.data_ptr()))
        return out

    graphs.run = watched
    for i in range(4):
        eng.add_request(str(i), [5, 9, 14, 20 + i], SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert graphs.logits is not None
    assert tuple(graphs.logits.shape) == (graphs.max_size, eng.runner.vocab_size)
    assert {n for n, _ in seen} >= {4, 2, 1}
    assert {ptr for _, ptr in seen} == {graphs.logits.data_ptr()}


@pytest.mark.parametrize("with_graphs", [False, True])
def test_dropped_engine_frees_its_kv_pool_without_gc(tiny_model_dir, with_graphs):
    """No reference cycle holds a dropped engine: with the cyclic GC off, its KV tensors, its
    runner and its decode graphs' buffers go with its last reference (a cycle would keep a GPU's
    KV pool, up to 85% of its memory, until a full GC, while the next engine sizes its own pool)."""
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.loader import load_model
    from batchery.engine.sampling import SamplingParams

    config = _config(tiny_model_dir)
    loaded = load_model(config)
    eng = LLMEngine(config, loaded=loaded)
    if with_graphs:
        eng.runner.graphs = eng.runner.build_decode_graphs(capture=False)
    eng.add_request("0", [5, 9, 14], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    refs = [weakref.ref(eng.runner), weakref.ref(eng.runner.kv_caches[0][0]), weakref.ref(eng)]
    if with_graphs:
        refs += [weakref.ref(eng.runner.graphs), weakref.ref(eng.runner.graphs.block_tables)]
    gc.collect()
    gc.disable()
    try:
        del eng
        alive = [r() for r in refs if r() is not None]
        assert not alive, f"held by a reference cycle after the engine was dropped: {[type(a).__name__ for a in alive]}"
    finally:
        gc.enable()
    assert loaded.model is not None  # the weights belong to the caller and stay


def test_decode_inputs_staged_through_persistent_host_buffers(tiny_model_dir):
    """The graph path's inputs go through persistent host buffers (pinned only on CUDA) into the
    static buffers; a smaller batch after a larger one leaves padding rows that store nothing
    (slot -1) and attend to nothing (context 0), and block tables are the persistent batch's rows
    (zero past each table's end, up to the step's widest table; columns past that keep an earlier
    step's entries, which no kernel reads)."""
    import numpy as np

    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.loader import load_model
    from batchery.engine.packed_step import PackedStep

    config = _config(tiny_model_dir)
    eng = LLMEngine(config, loaded=load_model(config))
    g = eng.runner.build_decode_graphs(capture=False)
    assert g.host_long.is_pinned() == (DEVICE == "cuda") == g.host_tables.is_pinned()
    width = g.block_tables.shape[1]
    tables = np.zeros((8, width), dtype=np.int32)  # a persistent batch's rows
    for r, t in enumerate([[5], [8, 3], [11, 2], [14, 9], [15, 16, 4], [10, 12, 1], [2]]):
        tables[r, : len(t)] = t

    def step(ids, pos, slots, rows, lens):
        a = [np.array(x, dtype=np.int64) for x in (ids, pos, slots, rows, lens)]
        width = max(int((tables[a[3]] != 0).sum(axis=1).max()), 1)
        return PackedStep(
            input_ids=a[0],
            positions=a[1],
            slots=a[2],
            block_tables=tables,
            decode_rows=a[3],
            decode_lens=a[4],
            decode_width=width,
        )

    g.stage(step([7, 8, 9, 10, 11], [4, 5, 6, 7, 8], [20, 33, 46, 59, 62], [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]), 6)
    assert g.block_tables[:5, :3].tolist() == [[5, 0, 0], [8, 3, 0], [11, 2, 0], [14, 9, 0], [15, 16, 4]]
    g.stage(step([3, 4], [9, 2], [41, 9], [5, 6], [10, 3]), 4)
    assert g.input_ids[0, :2].tolist() == [3, 4]
    assert g.positions[0, :2].tolist() == [9, 2]
    assert g.slots[:4].tolist() == [41, 9, -1, -1]
    assert g.context_lens[:4].tolist() == [10, 3, 0, 0]
    assert g.block_tables[:2, :3].tolist() == [[10, 12, 1], [2, 0, 0]]
    assert g.slots[4].item() == 62  # past the bucket: untouched, never read by this step
    g.stage(step([6], [2], [40], [6], [3]), 1)  # a table one block wide: only column 0 is written
    assert g.block_tables[0, :3].tolist() == [2, 12, 1]  # 12, 1: left by the last step, past this context


@pytest.mark.parametrize(
    ("device_kind", "free", "needed", "action"),
    [
        ("cpu", 0, 10 << 30, "rebuild"),  # host memory: today's rebuild, whatever is free
        ("cpu", None, 10 << 30, "rebuild"),
        ("cuda", 2 << 30, 10 << 30, "exit"),  # the hung thread holds the old pool: no room for a new one
        ("cuda", None, 10 << 30, "exit"),  # free memory unreadable: not assumed
        ("cuda", 10 << 30, 10 << 30, "rebuild"),  # the memory really is free
        ("cuda", 40 << 30, 10 << 30, "rebuild"),
    ],
)
def test_after_hang_policy(device_kind, free, needed, action):
    """After a hung step: on CUDA the worker exits (its messages go back to the queue) unless the
    device shows a new KV pool's worth of memory free; on the CPU it rebuilds as before."""
    from batchery.worker.service.supervisor import after_hang

    assert after_hang(device_kind, free, needed) == action


def test_engine_reports_its_kv_pool_bytes(tiny_model_dir):
    """What a replacement engine needs, as the supervisor reads it after a hang: the KV tensors' bytes."""
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.loader import load_model
    from batchery.worker.service.supervisor import _engine_memory

    config = _config(tiny_model_dir, attention_backend="auto")
    eng = LLMEngine(config, loaded=load_model(config))
    total = sum(k.nbytes + v.nbytes for k, v in eng.runner.kv_caches)
    assert eng.runner.kv_cache_bytes() == total > 0
    assert _engine_memory(eng) == (DEVICE, total)
    assert _engine_memory(None) is None


def test_eager_step_inputs_in_one_copy(tiny_model_dir):
    """The eager path's int inputs (slots, ids, positions, rows to sample, context lengths) go
    to the device as one packed copy and come back as views, each with its own values."""
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.loader import load_model

    config = _config(tiny_model_dir, attention_backend="auto")
    runner = LLMEngine(config, loaded=load_model(config)).runner
    a, b, c = runner._to_device([[5, 6, 7], [], [2**40]])
    assert [t.tolist() for t in (a, b, c)] == [[5, 6, 7], [], [2**40]]
    assert {t.dtype for t in (a, b, c)} == {torch.long}
    assert a.device.type == DEVICE


def test_graph_step_samples_only_the_rows_that_sample(tiny_model_dir):
    """A decode-only step through the graphs' static buffers in which one row is a one-token chunk of a
    longer recompute (it samples nothing) hands the sampler only the rows that sample, the same logits as
    the eager path, not the first rows of the bucket."""
    from batchery.engine.llm_engine import LLMEngine
    from batchery.engine.loader import load_model
    from batchery.engine.sampling import SamplingParams

    config = _config(tiny_model_dir)
    eng = LLMEngine(config, loaded=load_model(config))
    runner = eng.runner
    for i in range(2):
        eng.add_request(str(i), [5, 9, 14, 20 + i, 7, 8], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        eng.step()
    a, b = eng.scheduler.running
    a.num_computed_tokens -= 2  # two tokens to recompute: a one-token chunk of them samples nothing
    for seq in (a, b):
        eng.block_manager.allocate(seq, 1)  # what schedule() does before a step
    seen = []
    sampler = runner.sampler

    def recording(logits, seqs, eos_ids):
        seen.append((logits.clone(), list(seqs)))
        return sampler(logits, seqs, eos_ids)

    runner.sampler = recording
    eager = runner.run([a, b], [1, 1], eng.eos_ids)  # graphs off: the eager path
    runner.graphs = runner.build_decode_graphs(capture=False)
    graphed = runner.run([a, b], [1, 1], eng.eos_ids)
    assert runner.graphs.num_runs == 1
    (eager_logits, eager_seqs), (graph_logits, graph_seqs) = seen
    assert eager_seqs == graph_seqs == [b] == eager.sampled_seqs == graphed.sampled_seqs
    assert graph_logits.shape == eager_logits.shape == (1, runner.vocab_size)
    torch.testing.assert_close(graph_logits, eager_logits)
    assert graphed.token_ids == eager.token_ids
