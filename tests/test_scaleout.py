"""Scale-out on one Redis, with real worker processes (tiny model):

1. many workers, one queue: two workers of one model share the requests, and both take work;
2. queues per model: each worker consumes the queue its model's name gives it, and the client
   routes by model name, so requests for model B never reach model A's workers.

Each worker counts what it served in its own ``/metrics``. The models are two links to the
tiny model with unique names, so their queues (``batchery.<name>``) are this run's alone."""

from __future__ import annotations

import urllib.request
import uuid
from collections import Counter

import pytest
from conftest import WorkerFactory, wait_for
from prometheus_client.parser import text_string_to_metric_families

from batchery.client import Client
from batchery.contract.names import CHAT_TASK
from batchery.contract.settings import Settings, queue_for_model

pytestmark = pytest.mark.integration  # several real worker processes


def served(worker) -> float:
    """Chat requests this worker finished (its own counter)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.health_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "batchery_requests_total" and s.labels == {"task": CHAT_TASK, "outcome": "success"}:
                return s.value
    raise AssertionError("no batchery_requests_total sample for chat successes")


def client_for_model(factory: WorkerFactory, model: str) -> Client:
    """A client that picks its queue from the model name, as users do: ``Client(model=...)``."""
    return Client(
        settings=Settings(
            broker_url=factory.broker,
            result_backend=factory.backend,
            model=model,
            result_expires=600,
            max_task_timeout=60,
            task_timeout=60,
            retry_backoff_max=2,
            visibility_timeout=300,
        )
    )


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, redis_urls, tmp_path_factory):
    """Model A on two workers (two task threads each, so neither can hold all the work), model B on
    one. No BATCHERY_QUEUE: each worker derives its queue from its model."""
    d = tmp_path_factory.mktemp("scaleout")
    tag = uuid.uuid4().hex[:8]
    models = {}
    for name in ("a", "b"):
        link = d / f"scale-{tag}-{name}"
        link.symlink_to(tiny_model_dir, target_is_directory=True)
        models[name] = link
    f = WorkerFactory(tiny_model_dir, *redis_urls, d)
    spawn = {name: dict(BATCHERY_MODEL=str(path), BATCHERY_QUEUE="") for name, path in models.items()}
    a1 = f.spawn(queue_for_model(str(models["a"])), ready=False, BATCHERY_CONCURRENCY="2", **spawn["a"])
    a2 = f.spawn(queue_for_model(str(models["a"])), ready=False, BATCHERY_CONCURRENCY="2", **spawn["a"])
    b = f.spawn(queue_for_model(str(models["b"])), ready=False, **spawn["b"])
    for w in (a1, a2, b):
        w.wait_ready()
    yield {"factory": f, "models": models, "a": (a1, a2), "b": b}
    f.close()  # also drops the queues' kombu bindings


def test_each_worker_consumes_the_queue_its_model_names(cluster):
    a1, a2 = cluster["a"]
    for w, model in ((a1, "a"), (a2, "a"), (cluster["b"], "b")):
        name = cluster["models"][model].name
        assert w.count(rf"batchery worker ready: .* queue=batchery\.{name} ") == 1


def test_two_workers_on_one_queue_both_take_work(cluster):
    a1, a2 = cluster["a"]
    before = served(a1), served(a2)
    with client_for_model(cluster["factory"], cluster["models"]["a"].name) as c:
        assert c.queue == queue_for_model(str(cluster["models"]["a"]))
        hs = c.chat_many(
            [
                [{"role": "user", "content": f"write a story about the {w}"}]
                for w in "cat dog sea sky city river tree rain snow fire wind book".split()
            ],
            max_tokens=24,
            ignore_eos=True,
            temperature=0,
        )
        results = [h.get(timeout=120) for h in hs]
    assert all(r.usage.completion_tokens == 24 for r in results)
    # a worker counts a success just after storing its result, so the client can see it first
    wait_for(lambda: served(a1) + served(a2) - sum(before) >= 12, timeout=10, what="both success counters")
    n1, n2 = served(a1) - before[0], served(a2) - before[1]
    assert n1 + n2 == 12
    assert n1 >= 1 and n2 >= 1, f"one worker did all the work: {n1} and {n2}"
    # each result names the worker that ran it (an opaque id): two distinct ones, as often as each one served
    ids = [r.timing.worker for r in results]
    assert all(isinstance(i, str) and len(i) == 12 for i in ids), ids
    assert sorted(Counter(ids).values()) == sorted([n1, n2]), (ids, n1, n2)


def test_the_client_routes_by_model_name(cluster):
    a1, a2 = cluster["a"]
    b = cluster["b"]
    before = served(a1), served(a2), served(b)
    model_b = cluster["models"]["b"]
    # the bare name and the worker's full path name the same queue
    with client_for_model(cluster["factory"], model_b.name) as c:
        assert c.queue == queue_for_model(str(model_b)) != queue_for_model(str(cluster["models"]["a"]))
        results = [h.get(timeout=60) for h in c.chat_many([[{"role": "user", "content": "hello"}]] * 4, max_tokens=3)]
    assert {r.model for r in results} == {str(model_b)}  # the response names the model that served it
    wait_for(lambda: served(b) - before[2] >= 4, timeout=10, what="worker b's success counter")
    assert served(b) - before[2] == 4
    assert (served(a1), served(a2)) == before[:2]
