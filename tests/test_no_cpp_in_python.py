"""The C++ kernels live in engine/csrc/ as .cpp/.h files, never in Python strings (issue 41): no module under
``batchery`` (the engine, worker and tasks symlinks followed) holds C++ source in a string literal."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import batchery

ROOT = Path(batchery.__file__).parent
CSRC = ROOT / "engine" / "csrc"

# What C++ source has and prose about it does not: an include of a system header, an extension's registration, a
# function taking or returning a tensor, a preprocessor conditional on its own line.
CPP = re.compile(
    r"#include\s*[<\"]|\bTORCH_LIBRARY\b|\bPYBIND11_MODULE\b|\bat::Tensor\s+\w+\s*\(|\(\s*(const\s+)?at::Tensor[&\s]"
    r"|^\s*#\s*(ifdef|ifndef|endif|pragma|define)\b",
    re.MULTILINE,
)


def _python_files() -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(ROOT, followlinks=True):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(files)


def test_the_walk_sees_the_symlinked_packages():
    names = {p.relative_to(ROOT).as_posix() for p in _python_files()}
    for module in ("engine/cpu_kernels.py", "engine/attention/cpu_prefill.py", "worker/main.py", "tasks/__init__.py"):
        assert module in names


def test_no_module_holds_cpp_in_a_string():
    found = []
    for path in _python_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and CPP.search(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {CPP.search(node.value).group(0)!r}")
    assert not found, "C++ in Python strings (move it to engine/csrc/): " + "; ".join(found)


def test_the_pattern_catches_what_the_kernels_used_to_look_like():
    assert CPP.search("#include <torch/extension.h>\nat::Tensor f(at::Tensor x) { return x; }")
    assert CPP.search("void store_kv(at::Tensor key, at::Tensor value)")
    assert CPP.search("TORCH_LIBRARY(batchery, m) {}")
    assert not CPP.search("the bf16 linear (``linear_bf16``) returns an at::Tensor of the input's shape")


def test_the_kernel_sources_are_files_the_build_names():
    from batchery.engine import cpu_kernels

    sources = cpu_kernels.sources()
    assert sources and all(p.parent == cpu_kernels.CSRC and p.is_file() and p.suffix == ".cpp" for p in sources)
    assert {p.name for p in sources} == {p.name for p in CSRC.glob("*.cpp")}, "every .cpp in csrc/ is compiled"
    assert [p.name for p in cpu_kernels.headers()] == sorted(p.name for p in CSRC.glob("*.h"))
    bindings = (CSRC / "bindings.cpp").read_text()
    for name in cpu_kernels.functions():
        assert f'm.def("{name}", torch::wrap_pybind_function({name}), "{name}");' in bindings
    assert bindings.count("m.def(") == len(cpu_kernels.functions())
