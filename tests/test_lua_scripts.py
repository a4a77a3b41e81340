"""The job store's Lua scripts (``batchery/jobs/lua/``, issue 37): one script a ``.lua`` file, each opening with a
comment block that names its KEYS and its ARGV (and, for a script, what it returns and what it promises); each is
read as package data and compiles in the real Redis (``SCRIPT LOAD``), alone and after the prelude."""

from __future__ import annotations

import hashlib
from importlib.resources import files

import pytest

from batchery.jobs import lua

NAMES = sorted(f.name.removesuffix(".lua") for f in files(lua).iterdir() if f.name.endswith(".lua"))


def header(text: str) -> str:
    """The comment block the file opens with."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        lines.append(line)
    return "\n".join(lines)


def test_the_scripts_are_there():
    assert "prelude" in NAMES and {"claim", "write", "release", "cancel", "end_submit", "finalize"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_file_opens_with_its_keys_and_argv(name):
    head = header(lua.load(name))
    assert head, f"{name}.lua does not open with a comment"
    assert head.startswith(f"-- {name}:"), f"{name}.lua's comment does not open with its name"
    assert "KEYS" in head and "ARGV" in head, f"{name}.lua's opening comment names no KEYS or ARGV"
    if name != "prelude":
        assert "-- Returns:" in head and "-- Promises:" in head, f"{name}.lua says not what it returns or promises"


@pytest.mark.parametrize("name", NAMES)
def test_each_script_compiles_in_redis(r, name):
    for text in {lua.load(name), lua.load(name, prelude=True)}:
        assert r.script_load(text) == hashlib.sha1(text.encode()).hexdigest()
