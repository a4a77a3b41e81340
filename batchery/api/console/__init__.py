"""The web console of ``batchery serve`` (docs/console.md): jobs, a job's progress over time and its failures, the
workers, in the same process and port as the API. ``routes.router`` is mounted by ``batchery.api.app``."""
