"""The web console's routes: ``/`` (jobs), ``/jobs/{id}`` (a job), ``/workers``, ``/login``, ``/logout``, the job's
cancel, downloads and series, and ``/console/static/`` (CSS, JS and the vendored uPlot). Pages are rendered on the
server by Jinja2 with autoescaping on, so every value (custom_ids, metadata, error messages are user input) is
HTML-escaped; the JavaScript only swaps in the server's own fragments and draws the chart. Every answer carries a
Content-Security-Policy that allows scripts and styles from this server only (no inline script, no CDN)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.concurrency import run_in_threadpool

from batchery.api.auth import Tenant
from batchery.api.console.data import PAGE_SIZE, STATUSES, TRANSITIONS, Console, console_of
from batchery.api.console.session import (
    ConsoleKeys,
    Viewer,
    clear_cookie,
    csrf_ok,
    host_allowed,
    same_origin,
    set_cookie,
    viewer_of,
)
from batchery.api.errors import APIError
from batchery.api.files import files_of
from batchery.api.state import ApiState, state

HERE = Path(__file__).resolve().parent
STATIC_DIR = HERE / "static"
READ_CHUNK = 1 << 16
LOCAL_ONLY = "With no key configured, the console answers on localhost only."
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",  # with no-referrer, Chromium sends a form POST as Origin: null
    "Cache-Control": "no-store",
}

router = APIRouter(include_in_schema=False)


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600:02d}h"


def _when(t: float | None) -> str:
    if t is None:
        return "—"
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _rate(v: float | None) -> str:
    return "—" if v is None else f"{v:,.1f}"


_env = Environment(loader=FileSystemLoader(str(HERE / "templates")), autoescape=select_autoescape(default=True))
_env.filters.update(ago=_ago, when=_when, rate=_rate)


def _render(name: str, code: int = 200, **ctx: Any) -> HTMLResponse:
    return HTMLResponse(_env.get_template(name).render(**ctx), status_code=code, headers=HEADERS)


def _keys(st: ApiState) -> ConsoleKeys:
    keys = st.extras.get("console_keys")
    if keys is None:
        keys = st.extras["console_keys"] = ConsoleKeys(st.settings)
    return keys


def _who(request: Request) -> Viewer | Response:
    """The viewer, or the answer for a request that has none: a login redirect, or 403 for a foreign Host."""
    keys = _keys(state(request))
    if not host_allowed(request, keys):
        return _render(
            "error.html", 403, viewer=None, title="Forbidden", message="The console answers on localhost only."
        )
    viewer = viewer_of(request, keys)
    if viewer is None:
        return RedirectResponse("/login", status_code=303, headers=HEADERS)
    return viewer


def _not_found(viewer: Viewer | None, what: str) -> HTMLResponse:
    return _render("error.html", 404, viewer=viewer, title="Not found", message=f"No {what} here.")


def _console(request: Request) -> Console:
    return console_of(state(request))


@router.get("/login")
def login_page(request: Request) -> Response:
    keys = _keys(state(request))
    if not host_allowed(request, keys):
        return _render(
            "error.html", 403, viewer=None, title="Forbidden", message="The console answers on localhost only."
        )
    if not keys.enabled:
        return RedirectResponse("/", status_code=303, headers=HEADERS)
    return _render("login.html", viewer=None, error=None)


@router.post("/login")
async def login(request: Request) -> Response:
    keys = _keys(state(request))
    if not host_allowed(request, keys) or not same_origin(request):
        return _render("error.html", 403, viewer=None, title="Forbidden", message="This form must come from this site.")
    form = await request.form()
    key = str(form.get("key") or "").strip()
    if keys.viewer(key) is None or not keys.enabled:
        return _render("login.html", 401, viewer=None, error="That key is not one this server knows.")
    response = RedirectResponse("/", status_code=303, headers=HEADERS)
    set_cookie(response, request, key)
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    viewer = _who(request)
    if not isinstance(viewer, Viewer):
        return viewer
    form = await request.form()
    if not same_origin(request) or not csrf_ok(viewer, str(form.get("csrf") or "")):
        return _render("error.html", 403, viewer=viewer, title="Forbidden", message="Stale or foreign form.")
    response = RedirectResponse("/login", status_code=303, headers=HEADERS)
    clear_cookie(response)
    return response


@router.get("/")
def jobs_page(
    request: Request,
    status: str | None = Query(default=None, max_length=20),
    page: int = Query(default=1, ge=1, le=10_000),
    fragment: bool = False,
) -> Response:
    viewer = _who(request)
    if not isinstance(viewer, Viewer):
        return viewer
    status = status if status in STATUSES else None
    rows, pages = _console(request).page(viewer, status, page)
    page = min(page, pages)

    def link(**kw: Any) -> str:
        q = {"status": status, "page": page, **kw}
        return "/?" + urlencode({k: v for k, v in q.items() if v and not (k == "page" and v == 1)})

    ctx = dict(
        viewer=viewer,
        rows=rows,
        status=status,
        statuses=STATUSES,
        page=page,
        pages=pages,
        page_size=PAGE_SIZE,
        link=link,
        refresh=any(r.active for r in rows),
    )
    return _render("jobs_table.html" if fragment else "jobs.html", **ctx)


@router.get("/jobs/{job_id}")
def job_page(job_id: str, request: Request, fragment: bool = False) -> Response:
    viewer = _who(request)
    if not isinstance(viewer, Viewer):
        return viewer
    console = _console(request)
    row = console.row(viewer, job_id)
    if row is None:
        return _not_found(viewer, "such job")
    times = [(f.removesuffix("_at").replace("_", " "), getattr(row.job, f)) for f in TRANSITIONS]
    ctx = dict(
        viewer=viewer,
        row=row,
        times=[(name, t) for name, t in times if t is not None],
        failures=console.failures(row.job),
        errors=row.job.errors,
        refresh=row.active,
    )
    return _render("job_detail.html" if fragment else "job.html", **ctx)


@router.get("/jobs/{job_id}/series.json")
def job_series(job_id: str, request: Request) -> Response:
    viewer = _who(request)
    if not isinstance(viewer, Viewer):
        return viewer
    console = _console(request)
    row = console.row(viewer, job_id)  # also adds a point
    if row is None:
        return JSONResponse({"error": "not found"}, status_code=404, headers=HEADERS)
    return JSONResponse({"status": row.status, **console.series(job_id)}, headers=HEADERS)


@router.post("/jobs/{job_id}/cancel")
async def cancel_job(job_id: str, request: Request) -> Response:
    viewer = _who(request)
    if not isinstance(viewer, Viewer):
        return viewer
    form = await request.form()
    if not same_origin(request) or not csrf_ok(viewer, str(form.get("csrf") or "")):
        return _render("error.html", 403, viewer=viewer, title="Forbidden", message="Stale or foreign form.")
    if not await run_in_threadpool(_console(request).cancel, viewer, job_id):
        return _not_found(viewer, "such job")
    return RedirectResponse(f"/jobs/{job_id}", status_code=303, headers=HEADERS)


@router.get("/jobs/{job_id}/{kind}.jsonl")
def download(job_id: str, kind: str, request: Request) -> Response:
    """The job's output (``kind`` ``output``) or error records as JSONL: an API batch's written file, else the job
    store's records of that kind, in input order (``Console.records``)."""
    viewer = _who(request)
    if not isinstance(viewer, Viewer):
        return viewer
    if kind not in ("output", "errors"):
        return _not_found(viewer, "such file")
    console = _console(request)
    row = console.row(viewer, job_id)
    if row is None:
        return _not_found(viewer, "such job")
    file_id = row.output_file_id if kind == "output" else row.error_file_id
    headers = {**HEADERS, "Content-Disposition": f'attachment; filename="{job_id}_{kind}.jsonl"'}
    if file_id and row.tenant:
        try:
            _, f = files_of(state(request)).content(Tenant(row.tenant).id, file_id)
        except APIError:
            return _not_found(viewer, "such file")

        def blocks() -> Iterator[bytes]:
            with f:
                while block := f.read(READ_CHUNK):
                    yield block

        return StreamingResponse(blocks(), media_type="application/jsonl", headers=headers)
    errors = kind == "errors"

    def records() -> Iterator[bytes]:
        for rec in console.records(job_id):
            if (rec.get("error") is not None) == errors:
                yield json.dumps(rec, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"

    return StreamingResponse(records(), media_type="application/jsonl", headers=headers)


@router.get("/workers")
def workers_page(request: Request, fragment: bool = False) -> Response:
    viewer = _who(request)
    if not isinstance(viewer, Viewer):
        return viewer
    if not viewer.operator:
        return _not_found(viewer, "workers page for this key (an operator key sees it)")
    queues = _console(request).workers()
    return _render("workers_table.html" if fragment else "workers.html", viewer=viewer, queues=queues, refresh=True)


@router.get("/console/static/{name}")
def static(name: str) -> Response:
    """The console's own files (no directory listing, no path outside ``static/``)."""
    types = {".js": "text/javascript", ".css": "text/css", ".LICENSE": "text/plain"}
    path = STATIC_DIR / name
    if "/" in name or name.startswith(".") or not path.is_file() or path.suffix not in types:
        return Response("not found", status_code=404, media_type="text/plain", headers=HEADERS)
    headers = {**HEADERS, "Cache-Control": "public, max-age=3600"}
    return Response(path.read_bytes(), media_type=types[path.suffix] + "; charset=utf-8", headers=headers)
