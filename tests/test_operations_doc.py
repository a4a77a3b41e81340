"""docs/operations.md stays true: its configuration table is what ``Settings`` reads, and every
metric it names is one the worker exposes (and the other way round)."""

from __future__ import annotations

import re
from pathlib import Path

from batchery.contract.settings import env_table, env_variables
from batchery.worker.metrics import ENQUEUED_AT_HEADER, METRICS

DOC = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
COMPOSE_ONLY = {"BATCHERY_MODEL_CACHE", "BATCHERY_IMAGE_TAG", "BATCHERY_STOP_GRACE_PERIOD"}


def test_configuration_table_is_generated_from_settings():
    m = re.search(r"<!-- settings-table:start -->\n(.*?)<!-- settings-table:end -->", DOC.read_text(), flags=re.S)
    assert m, "docs/operations.md lost its settings-table markers"
    assert m.group(1) == env_table(), (
        "the configuration table in docs/operations.md is out of date: paste the output of "
        "`python -m batchery.contract.settings --table` between its markers"
    )


def test_every_variable_named_in_the_doc_exists():
    known = {var for var, _, _ in env_variables()} | COMPOSE_ONLY
    named = set(re.findall(r"\bBATCHERY_[A-Z0-9_]*[A-Z0-9]\b", DOC.read_text()))
    assert named - known == set(), f"docs/operations.md names unknown variables: {sorted(named - known)}"


def test_the_doc_lists_exactly_the_exposed_metrics():
    doc = DOC.read_text()
    listed = {m for m in re.findall(r"`(batchery_[a-z_]+)`", doc)}
    assert set(METRICS) <= listed, f"not documented: {sorted(set(METRICS) - listed)}"
    derived = {f"{name}{suffix}" for name in METRICS for suffix in ("_bucket", "_sum", "_count")}
    stale = {m for m in re.findall(r"\b(batchery_[a-z_]+)", doc)} - set(METRICS) - derived - {ENQUEUED_AT_HEADER}
    assert not stale, f"docs/operations.md names metrics the worker does not expose: {sorted(stale)}"


def test_every_variable_has_a_meaning():
    missing = [var for var, _, meaning in env_variables() if not meaning]
    assert not missing, f"give these settings a Field(description=...): {missing}"
