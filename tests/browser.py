"""Headless Chromium driven through chromedriver's W3C WebDriver HTTP API (a handful of JSON calls, so no client
library). Debian's `chromium` and `chromium-driver` packages provide both binaries."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from simulator.fleet import base_url, free_port

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1300,800"]
# Loopback only: the host's proxy variables must not catch the calls to chromedriver.
_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def missing() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    for binary, package in (("chromium", "chromium"), ("chromedriver", "chromium-driver")):
        if shutil.which(binary) is None:
            return f"{binary} is not installed (Debian package {package})"
    return None


class Browser:
    def __init__(self, driver_url: str, session: str) -> None:
        self.driver_url = driver_url
        self.session = session

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return webdriver(method, f"{self.driver_url}/session/{self.session}{path}", body)

    def open(self, url: str) -> None:
        self.call("POST", "/url", {"url": url})

    def run(self, script: str, *args: Any) -> Any:
        """Run `script` (a function body; `return` gives the result) in the page."""
        return self.call("POST", "/execute/sync", {"script": script, "args": list(args)})

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("GET", "/screenshot")))

    def wait_for(self, script: str, timeout_s: float = 15.0) -> Any:
        """Poll `script` until it returns something truthy; that value."""
        return wait_until(lambda: self.run(script), timeout_s, f"the page never satisfied: {script}")


def webdriver(method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    with _opener.open(request, timeout=60) as response:
        return json.load(response)["value"]


def wait_until(read: Callable[[], Any], timeout_s: float, message: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = read()
        except OSError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(message)
        time.sleep(0.2)


@contextmanager
def headless_chromium() -> Iterator[Browser]:
    """A chromedriver process and one browser session with a new, empty profile; both gone on leaving."""
    port = free_port()
    driver = subprocess.Popen(["chromedriver", f"--port={port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    profile = tempfile.mkdtemp(prefix="dashboard-chromium-")
    try:
        driver_url = base_url(port)
        wait_until(lambda: webdriver("GET", driver_url + "/status")["ready"], 20.0, "chromedriver did not start")
        options = {"binary": shutil.which("chromium"), "args": [*CHROMIUM_ARGS, f"--user-data-dir={profile}"]}
        created = webdriver("POST", driver_url + "/session", {"capabilities": {"alwaysMatch": {
            "browserName": "chrome", "goog:chromeOptions": options}}})
        browser = Browser(driver_url, created["sessionId"])
        try:
            yield browser
        finally:
            webdriver("DELETE", f"{driver_url}/session/{browser.session}")
    finally:
        driver.terminate()
        driver.wait(timeout=10)
        shutil.rmtree(profile, ignore_errors=True)
