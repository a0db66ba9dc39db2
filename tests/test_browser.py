"""Notebook 01 as a researcher meets it: JupyterLab on 127.0.0.1, headless Chromium driven by Selenium.

Run All, a click on the dashboard's Stop button while the later cells wait in the queue, then a save and a
reopen with the kernel gone. `.ci/run` installs Debian's chromium and chromium-driver and sets
RLBENCH_BROWSER_TESTS=required, so that there a missing browser fails the tests; elsewhere they skip, saying why.
JupyterLab and the browser are started here and stopped by their process ids. Screenshots land in the test's
folder, or in $RLBENCH_SCREENSHOTS when it is set.
"""

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

from test_notebooks import SMALL, with_parameters

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "01_quickstart.ipynb"
OTHERS = [NOTEBOOK.parent / name for name in ("05_agents.ipynb", "06_async.ipynb")]
"""Opened with Run All too, at the test suite's small parameters (their claims: tests/test_notebooks.py): what a
reader sees, an agent's episode and the async lab's figures and tables, renders without an error."""
PARAMETERS = {"STEPS": 100, "THREADS": 1}
"""The notebook's batches (a step takes ~0.3 s on one thread: a click's way to the kernel is a fraction of one),
and more steps than a Stop click leaves time for."""
WIDGET_ERROR = "Error displaying widget"


def _missing() -> str | None:
    if not (CHROMIUM and CHROMEDRIVER):
        return "Chromium and ChromeDriver are not installed (Debian: apt-get install chromium chromium-driver)"
    for module in ("selenium", "jupyterlab"):
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not installed (pip install -e '.[dev]')"
    return None


if (reason := _missing()) is not None:
    if os.environ.get("RLBENCH_BROWSER_TESTS") == "required":  # .ci/run installs them: missing there is a failure
        raise RuntimeError(f"the browser tests cannot run: {reason}")
    pytest.skip(reason, allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402


def until(condition, timeout: float, what: str, every: float = 0.2):
    """condition()'s first truthy value, polling; TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"waited {timeout} s for {what}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(process: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM to the process we started (JupyterLab shuts its kernels down on it), SIGKILL if it lingers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab serving a folder holding notebook 01 (with the small parameters) and `OTHERS`; yields (url, token,
    folder)."""
    home = tmp_path_factory.mktemp("lab")
    root = home / "notebooks"
    root.mkdir()
    nbformat.write(with_parameters(nbformat.read(NOTEBOOK, as_version=4), PARAMETERS), root / NOTEBOOK.name)
    for other in OTHERS:
        nbformat.write(with_parameters(nbformat.read(other, as_version=4), SMALL), root / other.name)
    settings = home / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)  # no "receive news?" toast over the page, no fetches to the internet
    (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false",
                                                                           "checkForUpdates": False}))
    port, token = _free_port(), secrets.token_hex(16)
    env = os.environ | {"JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_DATA_DIR": str(home / "data"),
                        "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"),
                        "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), "OMP_WAIT_POLICY": "PASSIVE"}
    log = (home / "lab.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}",
         "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
         *(["--allow-root"] if os.geteuid() == 0 else [])],  # CI runs as root
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def ready():
        try:
            return urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2).status == 200
        except OSError:
            assert process.poll() is None, f"JupyterLab exited: {(home / 'lab.log').read_text()[-2000:]}"
            return False

    try:
        until(ready, 120, "JupyterLab to answer")
        yield url, token, root
    finally:
        _stop(process)
        log.close()


@pytest.fixture
def browser(tmp_path):
    """Headless Chromium with its console log kept; quit, and its driver stopped by pid, afterwards."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-quic",
                 "--window-size=1400,1000", f"--user-data-dir={tmp_path / 'chromium'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = Service(CHROMEDRIVER)
    driver = webdriver.Chrome(service=service, options=options)
    try:
        yield driver
    finally:
        driver.quit()
        if service.process is not None:
            _stop(service.process)


def _screenshot(driver, tmp_path: Path, name: str) -> None:
    folder = Path(os.environ.get("RLBENCH_SCREENSHOTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(folder / f"{name}.png"))


def _menu(driver, menu: str, item: str) -> None:
    """Click a top menu, then its item labelled `item`."""
    driver.find_element(By.XPATH, f"//div[contains(@class, 'lm-MenuBar-itemLabel') and text()='{menu}']").click()
    until(lambda: driver.find_elements(By.XPATH, f"//li[contains(@class, 'lm-Menu-item')]"
                                                 f"[.//div[contains(@class, 'lm-Menu-itemLabel') and text()='{item}']]"),
          60, f"{menu} > {item}")[0].click()


def _open(driver, url: str, token: str, name: str) -> None:
    """Open the notebook and start its kernel (a notebook opened without a session asks which: the one it names)."""
    driver.get(f"{url}/lab/tree/{name}?token={token}")
    until(lambda: driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel .jp-Cell"), 60, "the notebook's cells")

    def kernel_idle():
        for button in driver.find_elements(By.CSS_SELECTOR, ".jp-Dialog .jp-Dialog-button.jp-mod-accept"):
            button.click()
        sessions = json.load(urllib.request.urlopen(f"{url}/api/sessions?token={token}"))
        return any(s["path"] == name and s["kernel"]["execution_state"] == "idle" for s in sessions)

    until(kernel_idle, 90, "the kernel to start")


def _prompts(driver) -> list[str]:
    return [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".jp-CodeCell .jp-InputPrompt")]


def _steps_shown(driver) -> tuple[int, int] | None:
    """(done, target) from the dashboard's progress label "27/100", or None while it is not shown."""
    for label in driver.find_elements(By.CSS_SELECTOR, ".widget-progress .widget-label, .jupyter-widgets label"):
        if match := re.fullmatch(r"(\d+)/(\d+)", label.text.strip()):
            return int(match[1]), int(match[2])
    return None


def _cell(driver, code: str):
    """The code cell whose source holds `code`, once it has rendered."""
    xpath = f"//div[contains(@class, 'jp-CodeCell') and contains(., '{code}')]"
    return until(lambda: driver.find_elements(By.XPATH, xpath), 60, f"the cell holding {code}")[0]


def _scroll_to_cell(driver, code: str) -> None:
    driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", _cell(driver, code))
    time.sleep(0.5)


def _record_shown(driver) -> bool:
    """Whether the dashboard's cell shows an image (its static record) and no widget."""
    cell = _cell(driver, "dash.start(STEPS)")
    return bool(cell.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output img")) and not cell.find_elements(
        By.CSS_SELECTOR, ".jupyter-widgets")


def _text(driver) -> str:
    """All the page's text, also of cells scrolled out of view (which Selenium's .text leaves out)."""
    return driver.execute_script("return document.body.textContent")


def _severe(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


def _rows(root: Path) -> int:
    """Steps the notebook's session logged (runs/<run>/metrics.jsonl beside the notebook)."""
    [log] = (root / "runs").glob("*/metrics.jsonl")
    return len(log.read_text().splitlines())


def test_browser_run_all_stop_save_and_reopen(lab, browser, tmp_path):
    try:
        _run_all_stop_save_and_reopen(*lab, browser, tmp_path)
    except BaseException:
        _screenshot(browser, tmp_path, "failure")
        raise


def _run_all_stop_save_and_reopen(url: str, token: str, root: Path, browser, tmp_path: Path) -> None:
    _open(browser, url, token, NOTEBOOK.name)
    _menu(browser, "Run", "Run All Cells")

    # past the first redraw of the curves (every 2 s), so that the screenshot shows some
    until(lambda: (shown := _steps_shown(browser)) and shown[0] >= 12, 240, "the dashboard to count 12 steps")
    stop = browser.find_element(By.XPATH, "//button[contains(@class, 'jupyter-button') and normalize-space()='Stop']")
    _scroll_to_cell(browser, "dash.start(STEPS)")
    _screenshot(browser, tmp_path, "dashboard-mid-run")
    clicked_at = _steps_shown(browser)[0]
    stop.click()
    until(lambda: all(re.fullmatch(r"\[\d+\]:", p) for p in _prompts(browser)), 300, "Run All to finish")

    steps = _rows(root)
    # the click ended the run: how many steps it took to reach the kernel depends on the machine's load (that the
    # step in progress finishes, and no more, is test_viz.py's test_start_trains_in_background_and_stop_works)
    assert clicked_at <= steps < PARAMETERS["STEPS"], f"Stop at {clicked_at} steps, the run went on to {steps}"
    _scroll_to_cell(browser, "dash.start(STEPS)")
    until(lambda: _record_shown(browser) or WIDGET_ERROR in _text(browser), 60,
          "an image of the finished run's curves where the dashboard was")
    _screenshot(browser, tmp_path, "after-run-all")
    assert WIDGET_ERROR not in _text(browser)
    assert not _severe(browser)
    assert _record_shown(browser), "the finished run left no image of its curves where the dashboard was"

    _menu(browser, "File", "Save Notebook")
    until(lambda: any(c.get("outputs") for c in json.loads((root / NOTEBOOK.name).read_text())["cells"]), 60,
          "the save")
    saved = nbformat.read(root / NOTEBOOK.name, as_version=4)
    widget_outputs = [o for c in saved.cells if c.cell_type == "code" for o in c.outputs
                      if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert not widget_outputs, f"{len(widget_outputs)} outputs are still widgets in the saved notebook"

    _menu(browser, "Kernel", "Shut Down Kernel")
    until(lambda: not json.load(urllib.request.urlopen(f"{url}/api/kernels?token={token}")), 60,
          "the kernel to shut down")
    _open(browser, url, token, NOTEBOOK.name)  # a new page: the saved file, a fresh kernel with no widget models
    _scroll_to_cell(browser, "dash.start(STEPS)")
    until(lambda: _record_shown(browser) or WIDGET_ERROR in _text(browser), 60, "the saved outputs to render")
    _screenshot(browser, tmp_path, "reopened-saved-notebook")
    assert WIDGET_ERROR not in _text(browser)
    assert not _severe(browser)
    assert _record_shown(browser)


@pytest.mark.parametrize("notebook", OTHERS, ids=[p.name for p in OTHERS])
def test_browser_runs_the_agents_and_async_notebooks_without_an_error(lab, browser, tmp_path, notebook):
    url, token, root = lab
    name = notebook.stem.split("_", 1)[1]
    try:
        _open(browser, url, token, notebook.name)
        _menu(browser, "Run", "Run All Cells")
        cells = sum(c.cell_type == "code" for c in nbformat.read(root / notebook.name, as_version=4).cells)

        def finished():  # the last cell has run (a long notebook's cells out of view show no prompt number)
            prompts = _prompts(browser)
            return "[*]:" not in prompts and prompts and prompts[-1] == f"[{cells}]:"
        until(finished, 600, "Run All to finish")
        # every image in an output has loaded (06's figures come from the repository wherever the lab started)
        images = []

        def loaded():
            images[:] = browser.execute_script("return Array.from(document.querySelectorAll('.jp-OutputArea-output "
                                               "img')).map(img => img.complete && img.naturalWidth > 0)")
            return images and all(images)

        with contextlib.suppress(TimeoutError):  # the assertion below says how many did not
            until(loaded, 60, "the outputs' images to load")
        assert images and all(images), f"{images.count(False)} of {len(images)} images did not load"
        _screenshot(browser, tmp_path, f"{name}-end")
        _scroll_to_cell(browser, "ep.show()" if notebook.name == "05_agents.ipynb" else "display(Image(")
        _screenshot(browser, tmp_path, f"{name}-episode" if notebook.name == "05_agents.ipynb" else f"{name}-figures")
        assert WIDGET_ERROR not in _text(browser)
        assert not _severe(browser)
        _menu(browser, "File", "Save Notebook")
        until(lambda: any(c.get("outputs") for c in json.loads((root / notebook.name).read_text())["cells"]), 60,
              "the save")
        saved = nbformat.read(root / notebook.name, as_version=4)
        errors = [o for c in saved.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
        assert not errors, [f"{o.ename}: {o.evalue}" for o in errors]
        if notebook.name == "05_agents.ipynb":  # the episode, coloured by who made each token
            shown = "".join(o.get("data", {}).get("text/html", "") for c in saved.cells if "ep.show()" in c.source
                            for o in c.outputs)
            assert "sampled" in shown and "tool" in shown
    except BaseException:
        _screenshot(browser, tmp_path, f"{name}-failure")
        raise
