"""The live console in a real browser (issue 38, "Must hold"): headless Chromium (Debian's
``chromium`` and ``chromium-driver``, driven by selenium) opens the console of real
``harbor-exec serve`` processes on 127.0.0.1, Harbor's backend on the engine:

* an oracle server with an API key, over tasks made here: the page answers without the
  key only with its sign-in form, refuses a wrong key, and opens with ``#key=...``; then it
  shows the counts, a rollout held running (its solve.sh reads a fifo the test writes
  once the page showed it) in its ``agent`` phase, a failure grouped under its reason, a
  task flagged always failing and a GRPO group flagged all-equal, and, once the held
  rollout is released, the page updates without a reload; its detail has the phases with
  teardown;
* a server with the example workflow agent (bundled), one rollout answered by the fake
  chat and one for a task the dataset does not have: its console shows both, the failure
  under its reason; its ``/docs`` and ``/redoc`` render from the server's own files.

Every request the browser made (Chrome's performance log) went to one of the two servers;
its console logged no error (but the two 401s of the sign-in, by design); a screenshot of
each console is kept (``test-artifacts/`` in the checkout, or ``$HARBOR_EXEC_TEST_ARTIFACTS``)
and its path printed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from harbor_exec.sandbox.docker import DockerRuntime
from harbor_exec.sandbox.runtime import LABEL_ROLLOUT
from tests.fake_chat import FakeChat
from tests.server_utils import free_port, wait_until
from tests.task_factory import make_task

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW_PROJECT = ROOT / "tasks_examples" / "workflow_project"
WORKFLOW_DATASET = ROOT / "tasks_examples" / "workflow_dataset"
KEY = "console-browser-key-0123456789"
KEY_ENV = "HARBOR_EXEC_TEST_CONSOLE_KEY"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: The fifo the held task's solve.sh reads; the test writes it (docker exec) to release.
GATE = "/tmp/console-gate"
HELD = f"mkfifo {GATE} && read -r _ < {GATE}"
NO_REWARD = 'echo "the tests ran, the reward file was forgotten"'
TIMEOUT = 90.0

# engine_lane: its own tasks, servers and browser; counts only its own rollouts' containers.
pytestmark = [
    pytest.mark.docker,
    pytest.mark.engine_lane,
    pytest.mark.long(30),
    pytest.mark.usefixtures("base_images"),
]


def _require(found: bool, what: str) -> None:
    """Missing browser parts fail under CI (a skip would hide a broken setup step)."""
    if found:
        return
    message = f"{what} is missing: run ./scripts/setup.sh (it installs it)"
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def artifacts_dir() -> Path:
    path = Path(os.environ.get("HARBOR_EXEC_TEST_ARTIFACTS") or ROOT / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


class Served:
    """``harbor-exec serve ARGS`` on a free port of 127.0.0.1, its output in a file."""

    def __init__(self, name: str, tmp_path: Path, *args: str, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / f"serve-{name}.log"
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable, "-m", "harbor_exec.cli", "serve", "--port", str(self.port),
                    "--trials-dir", str(tmp_path / f"{name}-trials"),
                    "--artifact-root", str(tmp_path / f"{name}-artifacts"),
                    "--data-dir", str(tmp_path / f"{name}-data"), "--no-package-cache", *args,
                ],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip

    def up(self, headers: dict[str, str] | None = None) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"serve exited: {self.log.read_text()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/health", headers=headers, timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def submit(
    server: Served,
    rollout_id: str,
    metadata: dict[str, Any],
    *,
    chat_url: str,
    prompt: str | None = None,
    headers: dict[str, str] | None = None,
) -> None:
    answer = httpx.post(
        f"{server.url}/rollout",
        json={
            "rollout_id": rollout_id,
            "initial_messages": [{"role": "user", "content": prompt}] if prompt else [],
            "chat_completions_url": chat_url,
            "metadata": metadata,
        },
        headers=headers,
        timeout=10,
    )
    assert answer.status_code == 202, answer.text


@pytest.fixture()
def browser() -> Iterator[Any]:
    """Headless Chromium that can reach 127.0.0.1 only: any other host resolves to
    nothing and any other address goes to a proxy that is not there."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _require(False, "selenium (the dev extra)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    _require(chromium is not None, "chromium (Debian's chromium package)")
    _require(driver_path is not None, "chromedriver (Debian's chromium-driver package)")
    assert chromium is not None and driver_path is not None
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
        "--window-size=1400,2400", "--no-first-run", "--no-default-browser-check",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--disable-default-apps", "--disable-domain-reliability", "--no-pings",
        "--disable-client-side-phishing-detection", "--disable-extensions",
        "--disable-features=OptimizationHints,MediaRouter,Translate,AutofillServerCommunication",
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
        "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=127.0.0.1",
    ):  # fmt: skip
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


#: What the console shows, read from its DOM: counts, running rows, failure rows, task
#: flags, all-equal groups, recent rollouts, whether the sign-in form is up, polls so far.
PAGE_STATE = """
const text = (node) => (node ? node.textContent.trim() : null);
const rows = (id) => Array.from(document.querySelectorAll(`#${id} tbody tr`))
  .map((tr) => Array.from(tr.children).map((td) => td.textContent.trim()));
const counts = {};
for (const card of document.querySelectorAll("#counts .card")) {
  counts[card.id.replace("count-", "")] = Number(text(card.querySelector(".n")));
}
return {
  counts,
  running: rows("running"),
  failures: rows("failures-agent").concat(rows("failures-infrastructure"))
    .filter((row) => row.length > 1),
  tasks: rows("tasks"),
  groups: rows("groups"),
  recent: rows("recent"),
  signin: !document.getElementById("signin").hidden,
  note: text(document.getElementById("signin-note")),
  polls: Number(document.getElementById("updated").dataset.polls || 0),
  marker: window.__sameDocument === true,
  hash: window.location.hash,
  stored: sessionStorage.getItem("harbor-exec-api-key"),
};
"""


def page_state(driver: Any) -> dict[str, Any]:
    state: dict[str, Any] = driver.execute_script(PAGE_STATE)
    return state


def wait_for_page(driver: Any, predicate: Callable[[dict[str, Any]], bool], what: str) -> None:
    """Until the page shows ``predicate`` (bounded); fails with what it shows."""
    last: dict[str, Any] = {}

    def shows() -> bool:
        nonlocal last
        last = page_state(driver)
        return predicate(last)

    assert wait_until(shows, timeout=TIMEOUT, interval=0.1), f"{what}: {json.dumps(last)}"


def requested_urls(driver: Any) -> list[str]:
    """Every URL the browser asked for since the last call (Chrome's performance log)."""
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def severe(driver: Any) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def screenshot(driver: Any, name: str) -> Path:
    path = artifacts_dir() / name
    driver.get_screenshot_as_file(str(path))
    print(f"screenshot: {path}")
    return path


def release(rollout_id: str) -> None:
    """Write the held trial's fifo (in its container), which ends its solve.sh."""
    client = docker.from_env()
    try:
        (container,) = client.containers.list(filters={"label": f"{LABEL_ROLLOUT}={rollout_id}"})
        result = container.exec_run(["bash", "-c", f"echo go > {GATE}"])
        assert result.exit_code == 0, result.output
    finally:
        client.close()


def test_console_in_a_real_browser(
    tmp_path: Path, browser: Any, chat: FakeChat, docker_runtime: DockerRuntime
) -> None:
    started = time.monotonic()
    tasks = tmp_path / "tasks"
    make_task(tasks, "passes")
    make_task(tasks, "never-passes", test="echo 0 > /logs/verifier/reward.txt")
    make_task(tasks, "forgets-reward", test=NO_REWARD)
    make_task(tasks, "held", solve=HELD)
    oracle = Served(
        "oracle", tmp_path, "--tasks-dir", str(tasks), "--task-mode", "dataset",
        "--agent", "oracle", "--max-concurrent-trials", "4", "--api-key-env", KEY_ENV,
        env={KEY_ENV: KEY},
    )  # fmt: skip
    workflow = Served(
        "workflow", tmp_path, "--tasks-dir", str(WORKFLOW_DATASET), "--task-mode", "dataset",
        "--agent", "arith_agent.workflow:ArithWorkflow",
        "--workflow-config", "arith_agent.workflow:workflow_config",
        "--code-dir", str(WORKFLOW_PROJECT), "--max-concurrent-trials", "2",
        env={},
    )  # fmt: skip
    chat.reset("correct")
    ids: set[str] = set()
    urls: list[str] = []
    try:
        assert wait_until(lambda: oracle.up(AUTH), timeout=TIMEOUT, interval=0.1)
        submit(oracle, "held-1", {"harbor_task_id": "held"}, chat_url=chat.base_url, headers=AUTH)
        load = {
            "pass-1": {"harbor_task_id": "passes", "group_id": "g-pass"},
            "pass-2": {"harbor_task_id": "passes", "group_id": "g-pass"},
            **{f"never-{i}": {"harbor_task_id": "never-passes"} for i in range(3)},
            "forgot-1": {"harbor_task_id": "forgets-reward"},
        }
        for rollout_id, metadata in load.items():
            submit(oracle, rollout_id, metadata, chat_url=chat.base_url, headers=AUTH)
        ids |= {"held-1", *load}
        # The workflow agent's server (its bundle built or found in the cache at start).
        assert wait_until(workflow.up, timeout=TIMEOUT, interval=0.1)
        submit(
            workflow, "wf-ok", {"harbor_task_id": "add-numbers"}, chat_url=chat.base_url,
            prompt="What is 40 + 2?",
        )  # fmt: skip
        submit(
            workflow, "wf-no-task", {"harbor_task_id": "no-such-task"}, chat_url=chat.base_url,
            prompt="What is 40 + 2?",
        )  # fmt: skip
        ids |= {"wf-ok", "wf-no-task"}

        # Without the key: the page's shell asks for it, and shows nothing of the server.
        browser.get(f"{oracle.url}/")
        wait_for_page(browser, lambda s: s["signin"], "the sign-in form")
        state = page_state(browser)
        assert state["counts"] == {} and state["tasks"] == [] and state["stored"] is None
        field = browser.find_element("id", "signin-key")
        field.send_keys("not-the-key")
        field.submit()
        wait_for_page(
            browser, lambda s: s["signin"] and s["note"] == "that key was refused", "refusal"
        )
        assert page_state(browser)["stored"] is None
        signin_errors = severe(browser)
        urls += requested_urls(browser)
        # The key through the address's fragment: taken, kept in the tab, off the address.
        browser.get(f"{oracle.url}/#key={KEY}")
        wait_for_page(browser, lambda s: not s["signin"] and "success" in s["counts"], "signed in")
        state = page_state(browser)
        assert state["hash"] == "" and state["stored"] == KEY
        assert "#key" not in browser.current_url
        browser.execute_script("window.__sameDocument = true;")

        # The held rollout runs in its agent phase; the rest finish around it.
        def everything_but_the_held(s: dict[str, Any]) -> bool:
            running = {row[0]: row for row in s["running"]}
            return (
                "held-1" in running
                and running["held-1"][2] == "agent"
                and s["counts"].get("success") == 5
                and s["counts"].get("failure") == 1
            )

        wait_for_page(browser, everything_but_the_held, "the load, held-1 in its agent phase")
        state = page_state(browser)
        assert state["counts"]["running"] == 1 and state["counts"]["queued"] == 0
        running = {row[0]: row for row in state["running"]}
        assert running["held-1"][1] == "held"  # its task
        (failure,) = state["failures"]
        # A task whose tests write no reward is the task's fault (validation_error).
        category, _origin, reason, count, last = failure
        assert (category, count, last) == ("validation_error", "1", "forgot-1"), failure
        assert reason.startswith("tests/test.sh wrote no reward"), failure
        flags = {row[0]: row[-1] for row in state["tasks"]}
        assert flags["never-passes"] == "always fails", state["tasks"]
        assert flags["passes"] == ""  # two finished: too few to flag
        groups = {row[0]: row for row in state["groups"]}
        assert list(groups) == ["g-pass"] and groups["g-pass"][1:] == ["passes", "2", "1.000"]
        polls_before = state["polls"]
        screenshot(browser, "console-oracle-running.png")

        # Released, it finishes: the same page (no reload) shows it.
        release("held-1")
        wait_for_page(
            browser,
            lambda s: s["counts"].get("success") == 6 and s["running"] == [["nothing running"]],
            "held-1 done",
        )
        state = page_state(browser)
        assert state["marker"] and state["polls"] > polls_before
        assert state["recent"][0][:3] == ["held-1", "held", "success"]
        # Its detail: the phases, teardown among them.
        browser.find_element("css selector", 'a[data-rollout="held-1"]').click()
        assert wait_until(
            lambda: (
                "teardown"
                in browser.execute_script(
                    "return document.getElementById('detail-phases')?.textContent || ''"
                )
            ),
            timeout=TIMEOUT,
        )
        screenshot(browser, "console-oracle.png")
        oracle_errors = severe(browser)
        urls += requested_urls(browser)

        browser.get(f"{workflow.url}/")
        wait_for_page(
            browser,
            lambda s: s["counts"].get("success") == 1 and s["counts"].get("failure") == 1,
            "the workflow server's two rollouts",
        )
        state = page_state(browser)
        (failure,) = state["failures"]
        assert failure[0] == "validation_error" and failure[4] == "wf-no-task", failure
        assert "no-such-task" in failure[2], failure
        recent = {row[0]: row for row in state["recent"]}
        assert recent["wf-ok"][2:4] == ["success", "1.000"], recent
        screenshot(browser, "console-workflow.png")
        # /docs and /redoc render from the server's files.
        browser.get(f"{workflow.url}/docs")
        assert wait_until(
            lambda: browser.execute_script(
                "return document.querySelectorAll('.opblock').length"
            ) > 0,
            timeout=TIMEOUT,
        )  # fmt: skip
        browser.get(f"{workflow.url}/redoc")
        assert wait_until(
            lambda: (
                "harbor-exec rollout server"
                in browser.execute_script("return document.querySelector('h1')?.textContent || ''")
            ),
            timeout=TIMEOUT,
        )
        other_errors = severe(browser)
        urls += requested_urls(browser)
    finally:
        oracle.stop()
        workflow.stop()
    print(f"browser test: {time.monotonic() - started:.1f} s")

    # Nothing but the two servers was asked for.
    assert urls and any(url.startswith(oracle.url) for url in urls)
    allowed = (f"{oracle.url}/", f"{workflow.url}/", "data:", "blob:", "about:")
    assert [url for url in urls if not url.startswith(allowed)] == []
    # No console errors, but the two 401s the sign-in answers by design.
    assert oracle_errors == [] and other_errors == [], (oracle_errors, other_errors)
    assert signin_errors and all("401" in message for message in signin_errors), signin_errors
    assert all(
        message.startswith((f"{oracle.url}/ ", f"{oracle.url}/console/data "))
        for message in signin_errors
    ), signin_errors
    # Nothing of theirs left on the engine.
    left = [
        c
        for c in docker_runtime.our_containers()
        if (c.get("Labels") or {}).get(LABEL_ROLLOUT) in ids
    ]
    assert left == []
