"""The web console in a real browser (issue 40): Debian's ``chromium`` and ``chromium-driver`` driven by Selenium
against ``create_app`` under uvicorn on a real socket, a real worker on the tiny model and the real ``openai`` SDK.

One test, in the order a person would go: an operator sees a worker appear on the workers page; key A logs in,
submits a batch (its metadata a ``<script>``), sees its progress bar advance on the jobs page (the script shown as
text, never run), opens it, sees the chart hold at least two points, cancels it (confirming the dialog) and sees
``cancelled``; key B does not see it and gets a 404 at its URL; the operator sees the worker disappear once it is
killed. Screenshots of the three pages go to docs/ (console-jobs.png, console-job.png, console-workers.png).

Without chromium it is skipped, except in CI (``CI`` set), where ``.ci/run`` installs it: there it fails."""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from api_util import ThreadServer, api_settings, drop_api_keys, openai_client  # noqa: E402
from conftest import wait_for  # noqa: E402

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
KEY_A = "sk-browser-a-" + "4" * 16
KEY_B = "sk-browser-b-" + "5" * 16
OPERATOR = "op-browser-" + "6" * 16
XSS = "<script>alert(1)</script>"
NUM_LINES = 3000  # more than the slow worker runs before the test cancels the job
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,900",
)


def _browser_or_skip() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        driver = None
    if chromium and driver:
        return chromium, driver
    why = "the browser test needs chromium, chromium-driver (apt-get install chromium chromium-driver) and selenium"
    if os.environ.get("CI"):
        pytest.fail(f"{why}; .ci/run installs them in CI")
    pytest.skip(why)


@pytest.fixture()
def browser():
    chromium, driver_path = _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="batchery-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def chat_line(n: int) -> dict:
    body = {"messages": [{"role": "user", "content": f"count to {n}"}], "max_tokens": 24, "temperature": 0}
    return {"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def login(driver, base: str, key: str) -> None:
    from selenium.webdriver.common.by import By

    driver.delete_all_cookies()
    driver.get(base + "/login")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "login").click()
    wait_for(lambda: driver.current_url.rstrip("/") == base, 10, what="the jobs page after the login")


def http_status(url: str, key: str) -> int:
    req = urllib.request.Request(url, headers={"Cookie": f"batchery_console={key}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def worker_rows(driver) -> list[str]:
    # read in one script: the page swaps its rows every two seconds, so a found element may be gone a moment later
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('tr.worker')).map(function (e) { return e.dataset.hostname; })"
    )


def done_of(driver, job_id: str) -> int | None:
    done = driver.execute_script(
        "var e = document.querySelector('tr[data-job=\"' + arguments[0] + '\"] .counts');"
        "return e ? e.dataset.done : null;",
        job_id,
    )
    return None if done is None else int(done)


def test_console_in_a_real_browser(browser, workers, redis_urls, tmp_path):
    from selenium.common.exceptions import NoAlertPresentException
    from selenium.webdriver.common.by import By

    driver = browser
    # a slow worker (two sequences at a time), loading while the server and the browser start
    worker = workers.spawn(ready=False, BATCHERY_MAX_NUM_SEQS="2", BATCHERY_CONCURRENCY="2")
    settings = api_settings(redis_urls, tmp_path, queue=worker.queue, keys=f"{KEY_A},{KEY_B}", operator_keys=OPERATOR)
    server = ThreadServer(settings).start()
    base = server.base_url
    try:
        # the operator watches the worker appear
        login(driver, base, OPERATOR)
        driver.get(base + "/workers")
        hostname = f"batchery-{worker.pid}@"
        wait_for(
            lambda: any(h and h.startswith(hostname) for h in worker_rows(driver)), 120, what="the worker to appear"
        )

        # key A submits a batch and watches it run
        login(driver, base, KEY_A)
        sdk = openai_client(base, KEY_A)
        data = "".join(json.dumps(chat_line(n)) + "\n" for n in range(NUM_LINES)).encode()
        file = sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = sdk.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"note": XSS}
        )
        first = wait_for(lambda: done_of(driver, batch.id), 60, what="the job's row with some lines done")
        wait_for(lambda: (done_of(driver, batch.id) or 0) > first, 60, what="the progress bar to advance")
        shown = driver.execute_script(
            "return document.querySelector('tr[data-job=\"' + arguments[0] + '\"] .metadata').textContent;", batch.id
        )
        assert XSS in shown  # shown as text
        with pytest.raises(NoAlertPresentException):
            driver.switch_to.alert.text  # noqa: B018 - and never run
        driver.save_screenshot(str(DOCS / "console-jobs.png"))

        # the job's page: the chart, then the cancel
        driver.find_element(By.CSS_SELECTOR, f'tr[data-job="{batch.id}"] a.job-link').click()
        wait_for(lambda: driver.find_elements(By.ID, "chart"), 10, what="the job page")
        points = "return Number(document.getElementById('chart').dataset.points || 0);"
        wait_for(lambda: driver.execute_script(points) >= 2, 30, what="two points on the chart")
        assert driver.find_elements(By.CSS_SELECTOR, "#chart canvas"), "uPlot drew no canvas"
        driver.save_screenshot(str(DOCS / "console-job.png"))
        driver.find_element(By.ID, "cancel").click()
        alert = wait_for(lambda: _alert(driver), 5, what="the confirmation dialog")
        assert batch.id in alert.text
        alert.accept()
        wait_for(lambda: _text(driver, "job-status") == "cancelled", 60, what="the job page to show cancelled")
        assert sdk.batches.retrieve(batch.id).status == "cancelled"

        # key B sees none of it
        login(driver, base, KEY_B)
        assert batch.id not in driver.page_source
        driver.get(f"{base}/jobs/{batch.id}")
        assert driver.find_element(By.ID, "error-title").text == "Not found"
        assert http_status(f"{base}/jobs/{batch.id}", KEY_B) == 404
        assert http_status(f"{base}/jobs/{batch.id}", KEY_A) == 200

        # the operator sees the worker go once it is killed
        login(driver, base, OPERATOR)
        driver.get(base + "/workers")
        wait_for(lambda: any(h and h.startswith(hostname) for h in worker_rows(driver)), 20, what="the worker row")
        driver.save_screenshot(str(DOCS / "console-workers.png"))
        worker.kill()
        wait_for(
            lambda: not any(h and h.startswith(hostname) for h in worker_rows(driver)),
            45,
            what="the killed worker to disappear (its announcement lasts 20 s)",
        )
    finally:
        server.stop()
        drop_api_keys(settings.result_backend, settings.api.key_prefix)


def _alert(driver):
    from selenium.common.exceptions import NoAlertPresentException

    try:
        return driver.switch_to.alert
    except NoAlertPresentException:
        return None


def _text(driver, element_id: str) -> str | None:
    return driver.execute_script(
        "var e = document.getElementById(arguments[0]); return e ? e.textContent.trim() : null;", element_id
    )
