"""The benchmarks against vLLM (benchmarks/vs_vllm.py, docqa.py, vllm_peer.py), without vLLM: the
workloads are deterministic, the docqa file is valid for Batchery's own batch parser, the fewest
prompt tokens a prefix cache can compute is counted right, outputs are checked whole."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import docqa  # noqa: E402
import vllm_peer  # noqa: E402
from workload import reference_requests  # noqa: E402

from batchery.contract.batch import LineError, output_record, parse_stream  # noqa: E402
from batchery.contract.schemas import ChatCompletionRequest  # noqa: E402


# -- the docqa workload ----------------------------------------------------------------------------
def test_docqa_lines_are_deterministic_and_shaped_as_asked():
    a = docqa.make_lines(96, 3, seed=0)
    assert a == docqa.make_lines(96, 3, seed=0)
    assert a != docqa.make_lines(96, 3, seed=1)
    assert len(a) == 288
    assert len({line["custom_id"] for line in a}) == 288
    docs: dict[str, int] = {}
    for line in a:
        system, user = line["body"]["messages"]
        assert system["role"] == "system" and user["role"] == "user"
        docs[system["content"]] = docs.get(system["content"], 0) + 1
        assert line["body"]["max_tokens"] == 32 and line["body"]["ignore_eos"] is True
    assert len(docs) == 96 and set(docs.values()) == {3}
    assert min(len(d.split()) for d in docs) >= 500
    # shuffled: a document's questions are not all next to each other
    firsts = [line["custom_id"].split("-")[0] for line in a[:20]]
    assert len(set(firsts)) > 10


def test_docqa_scales_down_with_docs_and_lines():
    lines = docqa.make_lines(4, 3, seed=0, num_lines=5, max_tokens=8)
    assert len(lines) == 5
    assert [x["custom_id"] for x in lines] == [x["custom_id"] for x in docqa.make_lines(4, 3, seed=0)[:5]]
    assert all(line["body"]["max_tokens"] == 8 for line in lines)


def test_docqa_file_is_valid_for_batcherys_parser(tmp_path):
    lines = docqa.make_lines(6, 3, seed=3)
    path = tmp_path / "docqa.jsonl"
    docqa.write_jsonl(path, lines)
    assert docqa.validate_file(path) == 18
    with open(path, "rb") as f:
        items = list(parse_stream(f, max_line_bytes=1 << 20))
    assert not [i for i in items if isinstance(i, LineError)]
    req = ChatCompletionRequest.model_validate(items[0].body)
    assert req.ignore_eos is True and req.max_tokens == 32


def test_validate_file_refuses_a_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    line = docqa.make_lines(1, 1)[0]
    line["body"]["max_tokens"] = -1
    docqa.write_jsonl(path, [line])
    with pytest.raises(ValueError, match="invalid_body"):
        docqa.validate_file(path)


def _record(line: dict, i: int, completion: int, prompt: int = 100, cached: int = 40) -> dict:
    body = {
        "id": f"chatcmpl-{i}",
        "object": "chat.completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }
    return output_record("batch_x", i + 1, line["custom_id"], f"req-{i}", body)


def test_outputs_must_answer_every_line_with_its_length(tmp_path):
    lines = docqa.make_lines(2, 2, max_tokens=8)
    path = tmp_path / "out.jsonl"
    docqa.write_jsonl(path, [_record(line, i, 8) for i, line in enumerate(lines)])
    got = docqa.read_outputs(path, lines, 8)
    assert set(got) == {line["custom_id"] for line in lines}
    assert docqa.prompt_usage(list(got.values())) == (400, 160)
    docqa.write_jsonl(path, [_record(line, i, 8) for i, line in enumerate(lines[:-1])])
    with pytest.raises(ValueError, match="1 of 4 lines not answered"):
        docqa.read_outputs(path, lines, 8)
    docqa.write_jsonl(path, [_record(line, i, 7) for i, line in enumerate(lines)])
    with pytest.raises(ValueError, match="7 completion tokens"):
        docqa.read_outputs(path, lines, 8)


def test_lines_by_worker_reads_celery_succeeded_lines(tmp_path):
    logs = [tmp_path / "w0.log", tmp_path / "w1.log"]
    logs[0].write_text(
        json.dumps({"message": "Task batchery.batch_line[a] succeeded in 1s", "custom_id": "doc000-q0"}) + "\n"
        "not json\n"
    )
    logs[1].write_text(
        json.dumps({"message": "Task batchery.batch_line[b] succeeded in 1s", "custom_id": "doc001-q0"})
        + "\n"
        + json.dumps({"message": "claiming", "custom_id": "doc002-q0"})
        + "\n"
    )
    assert docqa.lines_by_worker(logs) == {"doc000-q0": 0, "doc001-q0": 1}


# -- the least prompt work -------------------------------------------------------------------------
def test_min_prompt_tokens_exact():
    assert vllm_peer.min_prompt_tokens([[1, 2, 3, 4], [1, 2, 3, 5]]) == 5
    assert vllm_peer.min_prompt_tokens([[1, 2, 3], [1, 2]]) == 3  # the shorter first: the longer reuses it
    assert vllm_peer.min_prompt_tokens([[1, 2], [1, 2]]) == 3  # a repeat still computes its last token
    assert vllm_peer.min_prompt_tokens([[1, 2], [3, 4]]) == 4
    assert vllm_peer.min_prompt_tokens([]) == 0


def test_min_prompt_tokens_in_blocks():
    # the second reuses two full blocks (4 tokens) of its first len - 1 = 4 tokens
    assert vllm_peer.min_prompt_tokens([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], block_size=2) == 6
    # a partial block is never shared
    assert vllm_peer.min_prompt_tokens([[1, 2, 3, 4, 5], [1, 2, 3, 9, 6]], block_size=2) == 5 + 3
    # a whole repeated prompt: only the blocks within len - 1 tokens hit
    assert vllm_peer.min_prompt_tokens([[1, 2, 3, 4], [1, 2, 3, 4]], block_size=2) == 4 + 2
    assert vllm_peer.min_prompt_tokens([[1, 2, 3, 4], [1, 2, 3, 4, 5]], block_size=2) == 4 + 1
    with pytest.raises(ValueError):
        vllm_peer.min_prompt_tokens([[1]], block_size=0)


def test_min_prompt_tokens_against_a_brute_force_count_and_any_order():
    rng = random.Random(7)
    docs = [[rng.randrange(50) for _ in range(rng.randint(5, 30))] for _ in range(6)]
    prompts = [d + [rng.randrange(50) for _ in range(rng.randint(1, 6))] for d in docs for _ in range(3)]
    prompts += [prompts[0], prompts[0][:7]]  # a repeat and a prefix of another prompt
    distinct = {tuple(p[:i]) for p in prompts for i in range(1, len(p) + 1)}
    repeats = len(prompts) - len({tuple(p) for p in prompts})
    want = len(distinct) + repeats
    assert vllm_peer.min_prompt_tokens(prompts) == want
    shuffled = prompts[:]
    rng.shuffle(shuffled)
    assert vllm_peer.min_prompt_tokens(shuffled) == want
    blocked = vllm_peer.min_prompt_tokens(prompts, block_size=4)
    assert want <= blocked <= sum(map(len, prompts))
    assert vllm_peer.min_prompt_tokens(prompts, block_size=1) == want
    assert vllm_peer.min_prompt_tokens(shuffled, block_size=4) == blocked


# -- vs_vllm and the peer's plumbing ---------------------------------------------------------------
def test_reference_workload_is_deterministic():
    a = reference_requests(96, seed=0)
    assert a == reference_requests(96, seed=0) and len(a) == 96
    assert a[:64] == reference_requests(64, seed=0)
    assert all(16 <= m <= 128 for _, m in a)


def test_agreement():
    import vs_vllm

    ours = [[1] * 20, [2] * 20, [3] * 20, [4] * 20]
    theirs = [[1] * 20, [2] * 15 + [9] * 5, [3] * 3 + [0] * 17, [4] * 16]
    assert vs_vllm.agreement(ours, theirs) == 0.5  # the second differs at token 16, the third at 4


def test_no_vllm_venv_is_said_not_required(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_VENV", str(tmp_path / "missing"))
    assert vllm_peer.vllm_python() is None
    with pytest.raises(SystemExit, match="vllm_env.sh"):
        vllm_peer.require_vllm_python()


def test_vllm_env_binds_the_same_thread_count():
    env = vllm_peer.vllm_env(threads=1, kv_gib=2.5)
    assert env["OMP_NUM_THREADS"] == "1"
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) == 1
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2.5"
    assert "PYTHONPATH" not in env


def test_cpu_line_and_json_figures(tmp_path):
    line = vllm_peer.cpu_line()
    assert " cores, flags " in line
    path = tmp_path / "figures.json"
    vllm_peer.write_json(str(path), {"ratio": 1.5, "where": tmp_path})
    assert json.loads(path.read_text()) == {"ratio": 1.5, "where": str(tmp_path)}
    vllm_peer.write_json(None, {"ratio": 1.5})  # no path: nothing written, no error


def test_first_difference():
    import vs_vllm

    assert vs_vllm.first_difference([[1, 2, 3], [1] * 20], [[1, 9, 3], [1] * 20]) == [1, 16]
