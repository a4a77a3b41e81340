"""The job store's Lua scripts, one script a ``.lua`` file in this folder, each opening with its KEYS, its ARGV,
what it returns and what it promises. ``prelude.lua`` holds the helper functions the job store's scripts share
(``batchery.jobs.store``); ``load(name, prelude=True)`` puts it in front of the script.

The files are package data (``pyproject.toml``), read with ``importlib.resources``, so an installed wheel has them."""

from __future__ import annotations

from functools import cache
from importlib.resources import files


@cache
def load(name: str, *, prelude: bool = False) -> str:
    """The text of ``{name}.lua``, after ``prelude.lua``'s if ``prelude``."""
    text = files(__name__).joinpath(f"{name}.lua").read_text(encoding="utf-8")
    return load("prelude") + text if prelude else text
