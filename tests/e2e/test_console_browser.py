"""The console in a real headless Chromium (Debian's chromium and chromedriver, driven by
Selenium; nothing is downloaded), against real processes: a gateway with 2 workers in front
of two mock upstreams, and load from another process.

Sign in; the overview's request rate moves under load; a mock killed shows its breaker open
on the Upstreams page, and closed after it returns; a key made in the console is listed,
rotated (its secret shown once each time) and revoked; a key made in the console works from the
OpenAI SDK, and its revocation in the console refuses the next call within 1 s; the Spend page
says the ledger is not enabled; a profile's flame graph renders; the pages work from the
keyboard. A screenshot of
each page is saved under the test's tmp directory (and copied to VELOX_CONSOLE_SCREENSHOTS
when that names a directory: how docs/console/ is made).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from velox_lab.launch import GatewayProcess, free_port
from velox_lab.mock import MockUpstream

from .conftest import CLIENT_KEY, wait_for

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TOKEN = "console-admin-SECRET-0123456789"
FILE_KEY = "vx-console-load-SECRET-0123456789"
ROOT = Path(__file__).resolve().parents[2]
CONFIG = """
[[upstream]]
name = "alpha"
origin = "{a}"
ca_file = "{ca}"
api_key_env = "UP_KEY"
connections = 1

[[upstream]]
name = "beta"
origin = "{b}"
ca_file = "{ca}"
api_key_env = "UP_KEY"
connections = 1

[[route]]
model = "*"
targets = [{{ upstream = "alpha" }}, {{ upstream = "beta" }}]

[[key]]
name = "load-test"
sha256 = "{digest}"
rpm = 600000
max_parallel = 64

[breaker]
failures = 3
open_s = 1
max_open_s = 2
probe_interval_s = 1
"""
# Load from its own process: a bounded closed loop (at most 120 s or 500,000 requests).
LOAD = """
import sys
from velox_lab.closedloop import ClosedLoop, chat_request
body = b'{"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}'
loop = ClosedLoop("127.0.0.1", int(sys.argv[1]), chat_request(body, "Bearer " + sys.argv[2]),
                  concurrency=8, max_requests=500_000, max_seconds=120).start()
loop.join(130)
"""

def _need_chromium() -> None:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            pytest.fail(f"{path} is missing: `make chromium` (Debian's chromium and "
                        "chromium-driver) installs what the browser tests use")


def start_mock(name: str, certdir: str, port: int = 0) -> MockUpstream:
    return MockUpstream(tls=True, certdir=certdir, name=name,
                        extra_args=["--port", str(port)] if port else []).start()


@pytest.fixture(scope="module")
def mocks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, MockUpstream]]:
    certdir = str(tmp_path_factory.mktemp("console-certs"))
    started = {"alpha": start_mock("alpha", certdir), "beta": start_mock("beta", certdir)}
    try:
        yield started
    finally:
        for mock in started.values():
            mock.stop()


@pytest.fixture(scope="module")
def gw(mocks: dict[str, MockUpstream], tmp_path_factory: pytest.TempPathFactory,
       ) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("console-gw")
    config = tmp / "velox.toml"
    a, b = mocks["alpha"], mocks["beta"]
    config.write_text(CONFIG.format(a=a.origin, b=b.origin, ca=a.ca_file,
                                    digest=hashlib.sha256(FILE_KEY.encode()).hexdigest()))
    env = {"VELOX_CONFIG": str(config), "VELOX_WORKERS": "2", "VELOX_RATE_LIMIT_RPM": "0",
           "VELOX_SHUTDOWN_GRACE_S": "5", "VELOX_ACCESS_LOG": "0", "UP_KEY": "sk-up-0123456789",
           "VELOX_API_KEYS": CLIENT_KEY, "VELOX_ADMIN_TOKEN": TOKEN,
           "VELOX_ADMIN_ADDR": f"127.0.0.1:{free_port()}"}
    with GatewayProcess(env, log_path=tmp / "velox.log") as gateway:
        yield gateway


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("console-screenshots")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    _need_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tmp_path_factory.mktemp("chromium-profile")
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                "--window-size=1280,800", "--lang=en-GB"):
        options.add_argument(arg)
    service = Service(executable_path=CHROMEDRIVER,
                      log_output=str(tmp_path_factory.mktemp("chromedriver") / "driver.log"))
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()  # stops the chromedriver and chromium it started (by PID)


@pytest.fixture(scope="module")
def signed_in(browser: Any, gw: GatewayProcess, shots: Path) -> Any:
    from selenium.webdriver.common.by import By

    browser.get(f"{gw.admin_url}/ui")
    wait(browser, lambda d: d.find_element(By.ID, "signin").is_displayed())
    browser.find_element(By.ID, "token").send_keys("wrong-token")
    browser.find_element(By.CSS_SELECTOR, "#signin-form button").click()
    wait(browser, lambda d: "refused" in d.find_element(By.ID, "signin-error").text)
    token = browser.find_element(By.ID, "token")
    token.clear()
    token.send_keys(TOKEN)
    save(browser, shots, "signin")
    browser.find_element(By.CSS_SELECTOR, "#signin-form button").click()
    wait(browser, lambda d: d.find_element(By.ID, "page-overview").is_displayed())
    return browser


def wait(driver: Any, condition: Any, timeout: float = 30.0) -> Any:
    """Until `condition(driver)` is truthy. The page re-renders every second: an element
    replaced between finding and reading it is read again at the next try."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1,
                         ignored_exceptions=(StaleElementReferenceException,)).until(condition)


def save(driver: Any, where: Path, name: str) -> None:
    path = where / f"{name}.png"
    driver.save_screenshot(str(path))
    docs = os.environ.get("VELOX_CONSOLE_SCREENSHOTS")
    if docs:
        Path(docs).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(docs) / path.name)


def page(driver: Any, name: str) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.CSS_SELECTOR, f'#nav a[data-page="{name}"]').click()
    wait(driver, lambda d: d.find_element(By.ID, f"page-{name}").is_displayed())


def card(driver: Any, label: str) -> str:
    """A card's value as shown (read in the page: one step, never a replaced element)."""
    return str(driver.execute_script(
        "const c = document.querySelector(`.card[data-metric=\"${arguments[0]}\"] .value`);"
        "return c ? c.innerText : ''", label))


def number(text: str) -> float:
    match = re.match(r"[\d.,]+", text.replace("\u202f", "").replace(",", ""))
    return float(match.group(0)) if match else 0.0


@pytest.fixture(scope="module")
def load(gw: GatewayProcess) -> Iterator[Any]:
    """Starts the load process when first called (once per module)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        if not procs:
            procs.append(subprocess.Popen(
                [sys.executable, "-c", LOAD, str(gw.port), FILE_KEY], cwd=ROOT,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return procs[0]

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            proc.wait(10)


def samples_shown(driver: Any) -> int:
    return int(driver.execute_script("return window.veloxSamples ? veloxSamples() : 0"))


def test_overview_request_rate_moves_under_load(signed_in: Any, load: Any, shots: Path) -> None:
    driver = signed_in
    # Idle first (the start-up's /readyz polls are over), then the load from its own process.
    wait(driver, lambda d: number(card(d, "Requests")) < 5, timeout=60)
    idle = number(card(driver, "Requests"))
    load()

    def busy(d: Any) -> dict[str, str] | None:
        """The cards of one second under load (a loaded box can stall the load for a second,
        so the cards are judged together, as one sample showed them)."""
        shown = {name: card(d, name) for name in ("Requests", "Error rate (5xx)",
                                                  "Latency p50", "Tokens")}
        ok = (number(shown["Requests"]) >= 50 and shown["Error rate (5xx)"] == "0 %"
              and number(shown["Latency p50"]) > 0 and number(shown["Tokens"]) > 0)
        return shown if ok else None

    shown = wait(driver, busy, timeout=90)
    assert number(shown["Requests"]) > idle and shown["Requests"].endswith("req/s")
    assert shown["Latency p50"].endswith("ms") and shown["Tokens"].endswith("tok/min")
    # Ten seconds of history under load for the picture.
    start = samples_shown(driver)
    wait(driver, lambda d: samples_shown(d) >= start + 10, timeout=60)
    wait(driver, lambda d: d.execute_script(
        "return document.querySelectorAll('#page-overview canvas').length") >= 4)
    wait(driver, lambda d: len(d.find_elements("css selector", "#workers-table tbody tr")) == 2)
    # The charts draw on the next animation frame: the screenshot waits for it.
    driver.execute_script("return new Promise(r => requestAnimationFrame(() => r()))")
    save(driver, shots, "overview")


def breaker(driver: Any, name: str) -> str:
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, f'tr[data-upstream="{name}"] .badge')
    return found[0].get_attribute("data-state") if found else ""


def test_a_killed_upstream_shows_its_breaker_open_then_closed(
        signed_in: Any, load: Any, mocks: dict[str, MockUpstream], shots: Path) -> None:
    driver = signed_in
    load()
    page(driver, "upstreams")
    wait(driver, lambda d: breaker(d, "beta") == "closed" and breaker(d, "alpha") == "closed")
    victim = mocks["beta"]
    os.kill(victim.pid, signal.SIGKILL)
    # The breaker opens after 3 failures under load; the page polls every second.
    wait(driver, lambda d: breaker(d, "beta") in ("open", "half_open"), timeout=60)
    save(driver, shots, "upstreams-open")
    mocks["beta"] = start_mock("beta", str(Path(victim.ca_file).parent), port=victim.port)
    wait(driver, lambda d: breaker(d, "beta") == "closed", timeout=60)
    wait(driver, lambda d: "beta: open → " in d.find_element("id", "transitions").text)
    assert "beta: closed → open" in driver.find_element("id", "transitions").text
    save(driver, shots, "upstreams")


def make_key(driver: Any, name: str) -> str:
    """Create a key in the console; returns the secret the dialog showed once."""
    from selenium.webdriver.common.by import By

    page(driver, "keys")
    box = driver.find_element(By.ID, "create-box")
    if not box.get_attribute("open"):
        box.find_element(By.TAG_NAME, "summary").click()
    form = driver.find_element(By.ID, "create-form")
    form.find_element(By.NAME, "name").send_keys(name)
    rpm = form.find_element(By.NAME, "rpm")
    rpm.clear()
    rpm.send_keys("600")
    form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait(driver, lambda d: d.find_element(By.ID, "secret-dialog").is_displayed())
    secret = driver.find_element(By.ID, "secret-value").text
    assert secret.startswith("vx-"), secret
    return secret


def close_secret(driver: Any) -> None:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "secret-copy").click()
    wait(driver, lambda d: d.find_element(By.ID, "secret-copied").text)
    driver.find_element(By.ID, "secret-close").click()
    wait(driver, lambda d: not d.find_element(By.ID, "secret-dialog").is_displayed())
    assert driver.find_element(By.ID, "secret-value").text == ""  # not left in the page


def click_row_button(driver: Any, name: str, action: str) -> None:
    """Click a key row's button; a row re-rendered between finding and clicking (every
    second, with live usage) is found again."""
    def clicked(d: Any) -> bool:
        d.find_element("css selector",
                       f'tr[data-key="{name}"] button[data-action="{action}"]').click()
        return True

    wait(driver, clicked)


def test_create_rotate_and_revoke_a_key_in_the_console(
        signed_in: Any, gw: GatewayProcess, load: Any, shots: Path) -> None:
    from selenium.webdriver.common.by import By

    driver = signed_in
    load()
    secret = make_key(driver, "console-team")
    close_secret(driver)
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, 'tr[data-key="console-team"]'))
    assert secret not in driver.page_source
    # The file's key, used by the load: its use against its limits, read-only.
    def rate_shown(d: Any) -> float:
        text = d.find_element(By.CSS_SELECTOR, 'tr[data-key="load-test"]').text
        match = re.search(r"([\d,]+) / 600,000 req/min", text)
        return number(match.group(1)) if match else 0.0

    wait(driver, lambda d: rate_shown(d) > 0)
    assert not driver.find_elements(By.CSS_SELECTOR, 'tr[data-key="load-test"] button')
    save(driver, shots, "keys")
    click_row_button(driver, "console-team", "rotate")
    wait(driver, lambda d: d.find_element(By.ID, "confirm-dialog").is_displayed())
    driver.find_element(By.ID, "confirm-yes").click()
    wait(driver, lambda d: d.find_element(By.ID, "secret-dialog").is_displayed())
    rotated = driver.find_element(By.ID, "secret-value").text
    assert rotated.startswith("vx-") and rotated != secret
    close_secret(driver)
    wait(driver, lambda d: "old secret until" in d.find_element(
        By.CSS_SELECTOR, 'tr[data-key="console-team"]').text)
    click_row_button(driver, "console-team", "revoke")
    wait(driver, lambda d: d.find_element(By.ID, "confirm-dialog").is_displayed())
    driver.find_element(By.ID, "confirm-yes").click()
    wait(driver, lambda d: not d.find_elements(By.CSS_SELECTOR, 'tr[data-key="console-team"]'))
    with httpx.Client(base_url=gw.admin_url or "",
                      headers={"Authorization": f"Bearer {TOKEN}"}) as admin:
        actions = [e["action"] for e in admin.get("/audit").json()["entries"][:3]]
        assert actions == ["revoke", "rotate", "create"]
        assert admin.get("/keys/console-team").status_code == 404


def test_spend_page_shows_the_ledgers_totals(signed_in: Any, gw: GatewayProcess,
                                             shots: Path) -> None:
    # The gateway's ledger is on (its own state directory): a request of the file's key is
    # written to it, and the page reads /spend's list and shows the key's row.
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=FILE_KEY, max_retries=0,
                           timeout=20)
    try:
        client.chat.completions.create(model="gpt-4o-mini",
                                       messages=[{"role": "user", "content": "spend"}])
    finally:
        client.close()
    with httpx.Client(base_url=gw.admin_url or "",
                      headers={"Authorization": f"Bearer {TOKEN}"}) as admin:
        wait_for(lambda: any(r["key"] == "load-test"
                             for r in admin.get("/spend?since=7d&by=key").json()))
    driver = signed_in
    page(driver, "spend")
    wait(driver, lambda d: "Last 7 days, by key" in d.find_element("id", "spend-state").text)
    wait(driver, lambda d: "load-test" in d.find_element("id", "spend-table").text)
    save(driver, shots, "spend")


def test_a_profile_flame_graph_renders(signed_in: Any, load: Any, shots: Path) -> None:
    from selenium.webdriver.common.by import By

    driver = signed_in
    load()
    page(driver, "profile")
    seconds = driver.find_element(By.ID, "profile-seconds")
    seconds.clear()
    seconds.send_keys("5")
    driver.find_element(By.CSS_SELECTOR, "#profile-form button").click()
    wait(driver, lambda d: d.execute_script(
        "const i = document.getElementById('flamegraph');"
        "return i.complete && i.naturalWidth > 0"), timeout=90)
    assert driver.find_element(By.ID, "profile-state").text == "Done."
    save(driver, shots, "profile")


def test_keyboard_navigation_and_a_phone_sized_window(
        signed_in: Any, gw: GatewayProcess, shots: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver = signed_in
    driver.get(f"{gw.admin_url}/ui#/overview")
    wait(driver, lambda d: d.find_element(By.ID, "page-overview").is_displayed())
    # A page change moves the focus to the content (a reader hears the new page)...
    assert driver.switch_to.active_element.get_attribute("id") == "main"
    # ...and from the top, the skip link comes first, then the pages in order.
    driver.execute_script("document.querySelector('.skip').focus()")
    seen = []
    for _ in range(4):
        ActionChains(driver).send_keys(Keys.TAB).perform()
        seen.append(driver.switch_to.active_element.get_attribute("data-page"))
    assert seen == ["overview", "upstreams", "keys", "spend"]
    driver.switch_to.active_element.send_keys(Keys.ENTER)
    wait(driver, lambda d: d.find_element(By.ID, "page-spend").is_displayed())
    assert driver.find_element(By.CSS_SELECTOR, '#nav a[aria-current="page"]').text == "Spend"
    driver.set_window_size(390, 844)
    try:
        page(driver, "overview")
        width = driver.execute_script("return document.documentElement.scrollWidth")
        assert width <= 390 + 1, width  # nothing wider than the phone: no sideways scrolling
        save(driver, shots, "overview-phone")
    finally:
        driver.set_window_size(1280, 800)


# --- need the workers to enforce run-time keys (next step) --------------------------------

def test_a_console_made_key_works_from_the_openai_sdk(signed_in: Any, gw: GatewayProcess) -> None:
    secret = make_key(signed_in, "sdk-user")
    close_secret(signed_in)
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=secret, max_retries=0,
                           timeout=20)
    answer = client.chat.completions.create(model="gpt-4o-mini",
                                            messages=[{"role": "user", "content": "hi"}])
    assert answer.choices


def test_revoking_in_the_console_refuses_the_next_sdk_call_within_1s(
        signed_in: Any, gw: GatewayProcess) -> None:
    from selenium.webdriver.common.by import By

    driver = signed_in
    secret = make_key(driver, "sdk-revoked")
    close_secret(driver)
    client = openai.OpenAI(base_url=gw.base_url + "/v1", api_key=secret, max_retries=0,
                           timeout=20)
    messages = [{"role": "user", "content": "hi"}]
    client.chat.completions.create(model="gpt-4o-mini", messages=messages)  # type: ignore[arg-type]
    wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, 'tr[data-key="sdk-revoked"]'))
    click_row_button(driver, "sdk-revoked", "revoke")
    driver.find_element(By.ID, "confirm-yes").click()
    wait(driver, lambda d: not d.find_elements(By.CSS_SELECTOR, 'tr[data-key="sdk-revoked"]'))
    revoked_at = time.monotonic()

    def refused() -> bool:
        try:
            client.chat.completions.create(model="gpt-4o-mini", messages=messages)  # type: ignore[arg-type]
        except openai.AuthenticationError:
            return True
        return False

    wait_for(refused, timeout=5)
    assert time.monotonic() - revoked_at <= 1.0


def test_a_cross_site_form_post_from_the_browser_is_refused(
        browser: Any, mocks: dict[str, MockUpstream], tmp_path: Path) -> None:
    """Another site's page posts a form to an admin server bound WITHOUT a token (the case
    where no credential stands in the way): the browser sends it with its own Origin and
    Sec-Fetch-Site, and the admin server refuses it; nothing is created."""
    import http.server
    import threading

    from selenium.webdriver.common.by import By

    env = {"VELOX_UPSTREAM_ORIGIN": mocks["alpha"].origin,
           "VELOX_UPSTREAM_CA_FILE": mocks["alpha"].ca_file or "", "VELOX_WORKERS": "1",
           "VELOX_UPSTREAM_API_KEY": "sk-up-0123456789"}
    with GatewayProcess(env, log_path=tmp_path / "velox.log") as open_gw:
        page_html = (f'<!doctype html><form id="f" method="post" action="{open_gw.admin_url}/keys"'
                     ' enctype="text/plain"><input name=\'{"name": "csrf", "x": "\' '
                     'value=\'"}\'></form><script>document.getElementById("f").submit()'
                     '</script>').encode()

        class Evil(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(page_html)))
                self.end_headers()
                self.wfile.write(page_html)

            def log_message(self, *args: object) -> None:
                pass

        # A thread per connection: Chromium opens speculative connections that send nothing,
        # and a one-at-a-time server would sit on one of them while the page request waits.
        evil = http.server.ThreadingHTTPServer(("127.0.0.2", 0), Evil)  # another origin
        thread = threading.Thread(target=evil.serve_forever, daemon=True)
        thread.start()
        try:
            browser.get(f"http://127.0.0.2:{evil.server_address[1]}/")
            wait(browser, lambda d: "may not change anything" in d.find_element(
                By.TAG_NAME, "body").text)
        finally:
            evil.shutdown()
            evil.server_close()
        with httpx.Client(base_url=open_gw.admin_url or "") as client:
            assert client.get("/keys").json()["keys"] == []
            assert client.get("/audit").json()["entries"] == []
