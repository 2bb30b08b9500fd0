"""The course in a real browser: JupyterLab on 127.0.0.1 driven by headless Chromium.

For every chapter and exercise notebook this test opens it in JupyterLab (a copy of the
course in a temporary folder, so nothing is written into the repository), runs all cells from
the Run menu (the first cell is markdown: nothing is clicked into a code editor), waits for
the kernel, then checks what a learner would see:

* no error output, no "Error displaying widget", no JavaScript console error or page error;
* every Plotly chart rendered with at least one trace and a title;
* every ipywidgets view rendered; every control of every panel (``.edu3d-controls``) is turned
  through its range (each option of a dropdown, sampled past six, each toggle, a checkbox
  both ways, a slider's two ends; a move to where the control already is, which
  redraws nothing, is not made): each position must redraw without an error in the panel or
  in the console, and each panel must change under its controls;
* for a person to look at, a screenshot of the *whole* notebook (JupyterLab scrolls inside
  the page, so the notebook's own scroller is walked and the viewports stitched) in
  ``$EDU3D_SCREENSHOTS``, taken before the controls are turned: only when that is set (or
  run by hand), since nothing checks a picture and it costs 10-20 s a notebook.

Chromium is the distribution's package (``/usr/bin/chromium``, or ``$EDU3D_CHROMIUM``),
driven by Python Playwright with ``executable_path``: nothing is downloaded at run time.
Where Chromium or Playwright is missing the test skips and says so loudly; ``.ci/run``
installs both, and sets ``EDU3D_REQUIRE_BROWSER=1`` so that CI fails instead of skipping.

The machinery lives here; ``tests/test_browser.py`` checks chapters 00-06,
``tests/test_browser_late.py`` chapters 07-13 and ``tests/test_browser_exercises.py`` the
exercises (three files of 3 to 6 minutes, so that pytest-xdist's two workers share them). Run notebooks by hand, every one without arguments:
``python tests/browser.py notebooks/06_3d_parallelism.ipynb``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EARLY = 7  # chapters 00-06 in tests/test_browser.py, 07-13 in tests/test_browser_late.py
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
NOTEBOOKS = CHAPTERS + EXERCISES
CHROMIUM = os.environ.get("EDU3D_CHROMIUM", "/usr/bin/chromium")
TOKEN = "edu3d-browser-test"
# the flags a sandboxed, offline machine needs (no background connections to Google's hosts)
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]
# JupyterLab settings for the test's server: every cell rendered (no virtual scrolling, so
# every chart exists in the page), no autosave, no news or update checks (no network)
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}
CELL_TIMEOUT_S = float(os.environ.get("EDU3D_BROWSER_TIMEOUT", "240"))  # one notebook


def _missing() -> str | None:
    """Why the browser test cannot run here (None if it can)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Python Playwright is not installed (pip install playwright)"
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        return (f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium; or set "
                "EDU3D_CHROMIUM)")
    return None


def _not_run(reason: str, instead: str = "") -> str:
    """Say loudly that the browser checks cannot run (a failure under
    ``EDU3D_REQUIRE_BROWSER=1``); return the message."""
    message = f"BROWSER TEST NOT RUN: {reason}"
    if os.environ.get("EDU3D_REQUIRE_BROWSER") == "1":
        pytest.fail(message + " (EDU3D_REQUIRE_BROWSER=1)")
    sys.stderr.write(f"\n{'!' * 78}\n{message}\n{instead}{'!' * 78}\n")
    return message


def _skip_or_fail(reason: str) -> None:
    message = _not_run(reason)
    warnings.warn(message)
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def course_copy(dest: Path) -> Path:
    """The course as a learner has it (chapters, exercises, solutions, recorded data), in
    ``dest``: runs write their folders there, never into the repository."""
    ignore = shutil.ignore_patterns("runs", ".ipynb_checkpoints", "__pycache__")
    for name in ("notebooks", "exercises", "solutions"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    return dest


class Lab:
    """A JupyterLab server on 127.0.0.1 with a token, serving ``root``."""

    def __init__(self, root: Path, workdir: Path):
        self.root, self.port = root, _free_port()
        settings = workdir / "lab-settings"
        for name, value in LAB_SETTINGS.items():
            path = settings / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        env = {**os.environ, "JUPYTERLAB_SETTINGS_DIR": str(settings),
               "JUPYTER_CONFIG_DIR": str(workdir / "jupyter-config"),
               "JUPYTER_RUNTIME_DIR": str(workdir / "jupyter-runtime"),
               "EDU3D_SOLUTIONS": os.environ.get("EDU3D_SOLUTIONS", "1"),
               # chapter 00 trains on text for a minute; a quarter of it shows the same page
               "EDU3D_TEXT_SECONDS": os.environ.get("EDU3D_TEXT_SECONDS", "15"),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
                   p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)}
        self.log = open(workdir / "jupyterlab.log", "w")
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={root}",
               "--LabApp.news_url=", "--ServerApp.open_browser=False",
               # window.jupyterapp: the test opens and closes notebooks in one loaded app
               # with JupyterLab's own commands instead of reloading the page per notebook
               "--LabApp.expose_app_in_browser=True"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={TOKEN}",
                                            timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("JupyterLab did not start; see "
                                   f"{workdir / 'jupyterlab.log'}")
            time.sleep(0.3)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app_url(self) -> str:
        # a fresh workspace: no document open, nothing restored
        return f"{self.url}/lab/workspaces/edu3d-browser-test?reset&token={TOKEN}"

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(5)
        self.log.close()


# ---- what the page shows -------------------------------------------------------------------
RUNNING_JS = """() => {
  const prompts = [...document.querySelectorAll('.jp-CodeCell .jp-InputArea-prompt')];
  const busy = prompts.filter(p => p.textContent.includes('*')).length;
  const unrun = prompts.filter(p => /\\[\\s*\\]/.test(p.textContent)).length;
  const status = document.querySelector('.jp-Notebook-ExecutionIndicator');
  return {cells: prompts.length, busy, unrun,
          idle: !status || status.getAttribute('data-status') !== 'busy'};
}"""

REPORT_JS = """() => {
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  const out = {plots: [], errors: [], widgetErrors: 0, widgets: 0, controls: 0};
  if (!nb) return out;
  for (const el of nb.querySelectorAll('.js-plotly-plot')) {
    const title = (el.layout && el.layout.title && (el.layout.title.text || el.layout.title))
                  || '';
    const full = el._fullData || [];  // plotly.js's decoded traces (data may be base64)
    const traces = full.length;
    const size = (a) => (a && a.length) || 0;
    const points = full.reduce((n, t) => n + (t.visible === false ? 0 :
        (t._length || size(t.x) || size(t.y) || size(t.z) || size(t.values) ||
         (t.type === 'table' ? 1 : 0))), 0);
    out.plots.push({title: String(title).slice(0, 80), traces, points,
                    height: el.getBoundingClientRect().height});
  }
  for (const el of nb.querySelectorAll(
      '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')) {
    if (/Traceback|Error/.test(el.textContent) && el.closest('.jp-OutputArea-child')
        .querySelector('.jp-OutputPrompt')) out.errors.push(el.textContent.slice(0, 400));
  }
  for (const el of nb.querySelectorAll('.jp-RenderedText[data-mime-type="application/vnd.jupyter.error"], .jp-OutputArea-output.jp-mod-error'))
    out.errors.push(el.textContent.slice(0, 400));
  out.widgetErrors = [...nb.querySelectorAll('.jp-OutputArea-output')]
    .filter(el => el.textContent.includes('Error displaying widget')).length;
  out.widgets = nb.querySelectorAll('.jupyter-widgets').length;
  out.controls = nb.querySelectorAll('.edu3d-controls').length;
  return out;
}"""

PANEL_FIGURES_JS = """(box) => [...box.querySelectorAll('.js-plotly-plot')].map(el =>
  JSON.stringify([(el.layout && el.layout.title && el.layout.title.text) || '',
                  (el.data || []).map(t => [t.name, t.x, t.y, t.z, t.base])]))"""


OPEN_JS = """async (rel) => {
  const app = window.jupyterapp;
  await app.restored;
  const w = await app.commands.execute('docmanager:open', {path: rel, factory: 'Notebook'});
  await w.context.ready;
  await w.sessionContext.ready;
  return w.id;
}"""

# shut the notebook's kernel down, then close its tab (saved by then: nothing to ask)
CLOSE_JS = """async () => {
  const app = window.jupyterapp;
  for (const w of [...app.shell.widgets('main')]) {
    if (w.sessionContext) await w.sessionContext.shutdown();
    if (w.context && w.context.model) w.context.model.dirty = false;
    w.dispose();
  }
}"""

SETTLED_JS = """() => {
  const nb = document.querySelector('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook');
  if (!nb) return '';
  const plots = [...nb.querySelectorAll('.js-plotly-plot')];
  return [plots.length, plots.filter(el => el._fullData).length,
          nb.querySelectorAll('.jupyter-widgets').length,
          nb.querySelectorAll('.jp-OutputArea-output').length].join(',');
}"""


def load_app(page, lab: Lab) -> None:
    """Load JupyterLab once; notebooks are then opened and closed inside it."""
    page.goto(lab.app_url(), wait_until="domcontentloaded")
    page.wait_for_function("() => window.jupyterapp !== undefined", timeout=120_000)
    page.evaluate("async () => { await window.jupyterapp.restored; }")


def open_notebook(page, rel: str) -> None:
    """Open ``rel`` with JupyterLab's ``docmanager:open`` and wait for its kernel."""
    page.evaluate(OPEN_JS, rel)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=60_000)
    # the toolbar says idle once the kernel has started, and the status bar says "Idle"
    # once it is connected (the toolbar can say idle before that, and a command sent then
    # is lost)
    page.wait_for_function(
        "() => { const s = document.querySelector('.jp-NotebookPanel .jp-Notebook-ExecutionIndicator');"
        " return s && s.getAttribute('data-status') === 'idle'; }", timeout=90_000)
    page.wait_for_function(
        "() => [...document.querySelectorAll('.jp-StatusBar-TextItem')]"
        ".some(e => /\\|\\s*Idle/.test(e.textContent))", timeout=90_000)


def close_notebook(page) -> None:
    page.evaluate(CLOSE_JS)


def run_all(page, rel: str) -> float:
    """Run All Cells from the Run menu; wait until every code cell has run and the kernel is
    idle; return the seconds that took."""
    before = page.evaluate(RUNNING_JS)
    start = time.monotonic()
    for attempt in range(3):
        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-item:not(.lm-mod-disabled) .lm-Menu-itemLabel",
                     has_text="Run All Cells").first.click()
        started = time.monotonic() + 15
        while time.monotonic() < started:
            state = page.evaluate(RUNNING_JS)
            if state["busy"] or state["unrun"] < before["unrun"]:
                break
            time.sleep(0.25)
        else:
            page.keyboard.press("Escape")
            continue
        break
    else:
        raise AssertionError(f"{rel}: Run All Cells did not start (3 tries)")
    deadline = start + CELL_TIMEOUT_S
    while True:
        state = page.evaluate(RUNNING_JS)
        if state["cells"] and state["busy"] == 0 and state["unrun"] == 0 and state["idle"]:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{rel}: cells still running after {CELL_TIMEOUT_S:g} s: "
                                 f"{state}")
        time.sleep(0.25)
    return time.monotonic() - start


def settle(page, quiet_s: float = 0.6, limit_s: float = 10.0) -> None:
    """Wait for the last outputs to be drawn (plotly.js and widget views render after their
    message): until every chart has drawn and nothing changed for ``quiet_s``."""
    deadline = time.monotonic() + limit_s
    last, since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = page.evaluate(SETTLED_JS)
        plots, drawn = (int(x) for x in (now.split(",")[:2] if now else (0, 0)))
        if now != last:
            last, since = now, time.monotonic()
        elif plots == drawn and time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.15)


VIEWPORT = {"width": 1400, "height": 1000}


def screenshot_whole(page, path: Path) -> None:
    """The whole notebook, not one viewport: walk the notebook's own scroller (JupyterLab
    scrolls inside the page) and stitch the views, top to bottom. (A taller page was tried:
    no faster, since a capture costs by its pixels, and JupyterLab pads the notebook's end
    by a page height.)"""
    import io

    from PIL import Image  # matplotlib's own image library

    scroller = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer")
    if scroller.count() == 0:
        page.screenshot(path=str(path))
        return
    box = scroller.first.bounding_box()
    handle = scroller.first.element_handle()
    total = page.evaluate("(el) => el.scrollHeight", handle)
    view = int(box["height"])
    tiles, top = [], 0
    while True:
        page.evaluate("([el, y]) => { el.scrollTop = y; }", [handle, top])
        page.wait_for_timeout(60)
        actual = page.evaluate("(el) => el.scrollTop", handle)
        tile = Image.open(io.BytesIO(page.screenshot(clip=box))).convert("RGB")
        skip = int(round(top - actual))  # the last view stops early: drop rows already shown
        tiles.append(tile.crop((0, skip, tile.width, tile.height)) if skip > 0 else tile)
        top = actual + view
        if top >= total or len(tiles) > 60:
            break
    whole = Image.new("RGB", (tiles[0].width, sum(t.height for t in tiles)), "white")
    y = 0
    for t in tiles:
        whole.paste(t, (0, y))
        y += t.height
    whole.save(path, compress_level=1)
    page.evaluate("(el) => { el.scrollTop = 0; }", handle)


PANEL_STATE_JS = """(box) => {
  const out = box.querySelector('.jupyter-widgets-output-area, .widget-output');
  const plots = [...box.querySelectorAll('.js-plotly-plot')];
  return {sig: JSON.stringify([(out && out.textContent) || '', plots.map(el =>
            [(el.layout && el.layout.title && el.layout.title.text) || '',
             (el.data || []).map(t => [t.name, t.x, t.y, t.z, t.base])])]),
          drawn: plots.every(el => el._fullData),
          failed: /Traceback|this setting failed/.test((out && out.textContent) || '')
                  ? out.textContent.slice(0, 300) : ''};
}"""

# every control of a panel, as (kind, index): dropdowns, toggle buttons, checkboxes, sliders
CONTROLS_JS = """(box) => {
  const found = [];
  box.querySelectorAll('select').forEach((el, i) => found.push(['select', i,
      (el.closest('.widget-dropdown')?.querySelector('label')?.textContent) || '']));
  box.querySelectorAll('.widget-toggle-buttons').forEach((el, i) => found.push(['toggle', i,
      el.querySelector('label')?.textContent || '']));
  box.querySelectorAll('.widget-checkbox input').forEach((el, i) => found.push(['checkbox', i,
      el.closest('.widget-checkbox').textContent]));
  box.querySelectorAll('.noUi-handle').forEach((el, i) => found.push(['slider', i,
      (el.closest('.widget-slider')?.querySelector('label')?.textContent) || '']));
  return found;
}"""
SLIDER_KEYS = ("End", "Home")  # both ends: every step between is turned headless, in seconds
# (tests/test_every_control.py); here each control must redraw in the page without an error
MAX_OPTIONS = 6  # a longer dropdown is sampled: its ends and options evenly between
# (every option of every knob is turned headless, in seconds: tests/test_every_control.py)
# jupyterlab-plotly's renderer redraws a chart and then, once the redraw's promise resolves,
# calls Plotly.Plots.resize on it (onUpdateRequest); if the output area replaced the chart in
# between (a panel's redraw, or the panel clearing its static copy once its widget is drawn),
# plotly rejects that promise with this message: the old div is gone, the new one is drawn,
# nothing is lost. It can arrive in any phase, a little after the redraw that caused it.
PLOTLY_DETACHED = "Resize must be passed a displayed plot div element"
# The same race met from the other side: the renderer purges the chart it is about to redraw
# (Plotly.purge -> cleanPlot -> destroy), and when the output area has already taken that
# div out of the page, plotly's destroy reads the parent of a detached node. Forgiven only
# with a stack that lies wholly in plotly's purge inside jupyterlab-plotly's bundle: the same
# message from anywhere else still fails the chapter.
PLOTLY_PURGED = "Cannot read properties of null (reading 'removeChild')"


def _plotly_purge_race(entry: dict) -> bool:
    stack = entry.get("stack", "")
    frames = [line for line in stack.splitlines()[1:] if line.strip().startswith("at ")]
    return (entry["type"] == "pageerror" and entry["text"].startswith(PLOTLY_PURGED)
            and ".purge (" in stack and bool(frames)
            and all("jupyterlab-plotly" in f or "<anonymous>" in f for f in frames))


def console_errors(entries: list) -> list:
    """The console's errors and page errors, less the two harmless plotly races above."""
    return [c for c in entries if c["type"] in ("error", "pageerror")
            and not c["text"].startswith(PLOTLY_DETACHED) and not _plotly_purge_race(c)]


def panel_state(page, box) -> dict:
    return page.evaluate(PANEL_STATE_JS, box.element_handle())


# counts the kernel's "idle" status messages: a widget's change reaches the kernel as a comm
# message, which it answers busy, runs the panel's handler, then idle
IDLE_COUNTER_JS = """() => {
  const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
  if (!k.__edu3dCounted) {
    k.__edu3dCounted = true;
    window.__edu3dIdle = 0;
    k.iopubMessage.connect((_, msg) => {
      if (msg.header.msg_type === 'status' && msg.content.execution_state === 'idle')
        window.__edu3dIdle += 1;
    });
  }
  return window.__edu3dIdle;
}"""


def idle_count(page) -> int:
    """The kernel's idle messages so far (the counter is installed on first call)."""
    return page.evaluate(IDLE_COUNTER_JS)


def wait_redrawn(page, box, before: str, idle_before: int, limit_s: float = 3.0,
                 quiet_s: float = 0.4) -> dict:
    """Wait until the panel's output changed from ``before`` and its charts are drawn; or,
    for a position that draws what the last one drew, until the kernel has gone idle after
    the move (its handler ran: ``idle_before`` idle messages were counted before it) and the
    panel stayed the same, drawn, for ``quiet_s``; at most ``limit_s``."""
    deadline = time.monotonic() + limit_s
    now, quiet_since = panel_state(page, box), None
    while time.monotonic() < deadline and (now["sig"] == before or not now["drawn"]):
        if now["drawn"] and idle_count(page) > idle_before:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= quiet_s:
                break
        page.wait_for_timeout(80)
        now = panel_state(page, box)
    return now


def _slider_stays(handle, key: str) -> bool:
    """Whether ``key`` (one of :data:`SLIDER_KEYS`) leaves the slider where it is: End at
    its top, Home at its bottom, read from the handle's ARIA values."""
    now, low, high = (handle.get_attribute(a) for a in
                      ("aria-valuenow", "aria-valuemin", "aria-valuemax"))
    try:
        now, low, high = float(now), float(low), float(high)
    except (TypeError, ValueError):
        return False  # not readable: make the move
    return now >= high if key == "End" else now <= low


def turn_every_control(page, box) -> dict:
    """Turn every control of one panel through its range: each option of a dropdown (a
    sample of :data:`MAX_OPTIONS` past that), each toggle button, a checkbox both ways, a
    slider's two ends (keys on its handle). Return the positions turned, how many
    changed the panel, what failed, and the slowest positions (seconds until redrawn: where
    the browser test's time goes)."""
    positions, changed, failed, took = 0, 0, [], []
    for kind, i, label in page.evaluate(CONTROLS_JS, box.element_handle()):
        moves = []
        if kind == "select":
            n = box.locator("select").nth(i).locator("option").count()
            picks = range(n) if n <= MAX_OPTIONS else sorted(
                {round(k * (n - 1) / (MAX_OPTIONS - 1)) for k in range(MAX_OPTIONS)})
            moves = [("select", k) for k in picks]
        elif kind == "toggle":
            n = box.locator(".widget-toggle-buttons").nth(i).locator("button").count()
            moves = [("toggle", k) for k in range(n)]
        elif kind == "checkbox":
            moves = [("checkbox", 0), ("checkbox", 1)]
        else:
            moves = [("slider", key) for key in SLIDER_KEYS]
        for how, arg in moves:
            before, idle_before = panel_state(page, box)["sig"], idle_count(page)
            if how == "select":
                select = box.locator("select").nth(i)
                if arg >= select.locator("option").count():  # a redraw narrowed the options
                    continue
                if select.evaluate("(s) => s.selectedIndex") == arg or select.is_disabled():
                    continue  # there already, or greyed out (it does not apply now)
                select.select_option(index=arg)
            elif how == "toggle":
                button = box.locator(".widget-toggle-buttons").nth(i).locator("button").nth(arg)
                if button.evaluate("(b) => b.classList.contains('mod-active') || b.disabled"):
                    continue  # there already (drawn), or greyed out
                button.click()
            elif how == "checkbox":
                box.locator(".widget-checkbox input").nth(i).click()
            else:
                handle = box.locator(".noUi-handle").nth(i)
                if _slider_stays(handle, arg):
                    continue  # already at that end: the key would redraw nothing
                handle.press(arg)
            positions += 1
            start = time.monotonic()
            now = wait_redrawn(page, box, before, idle_before)
            changed += now["sig"] != before
            took.append((round(time.monotonic() - start, 1), f"{label.strip() or kind} {arg}",
                         now["sig"] != before))
            if now["failed"]:
                failed.append(f"{label.strip() or kind} {arg}: {now['failed']}")
    return {"positions": positions, "changed": changed, "failed": failed,
            "slowest": sorted(took, reverse=True)[:3]}


def turn_every_panel(page) -> list[dict]:
    """Every control of every panel in the open notebook, turned (:func:`turn_every_control`)."""
    boxes = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .edu3d-controls")
    out = []
    for b in range(boxes.count()):
        box = boxes.nth(b)
        box.scroll_into_view_if_needed()
        title = box.locator(".js-plotly-plot").first
        out.append({"panel": b, "title": title.evaluate(
            "(el) => ((el.layout && el.layout.title && el.layout.title.text) || '')"
            ".slice(0, 60)") if title.count() else "", **turn_every_control(page, box)})
    return out


def compare_saved(page, lab: Lab, nb: Path, rel: str) -> list[str]:
    """Save the notebook from JupyterLab (File > Save Notebook, into the course copy) and
    compare its checked cells with the committed notebook, as ``pytest --nbval-lax`` does:
    the chapters are executed once, here, not once more by nbval."""
    import nbformat

    from edu3d.course import nbtools

    saved = lab.root / rel
    before = saved.stat().st_mtime_ns
    page.locator(".lm-MenuBar-itemLabel", has_text="File").first.click()
    page.locator(".lm-Menu-item:not(.lm-mod-disabled) .lm-Menu-itemLabel",
                 has_text="Save Notebook").first.click()
    deadline = time.monotonic() + 60
    while saved.stat().st_mtime_ns == before:
        if time.monotonic() > deadline:
            return ["JupyterLab did not save the notebook within 60 s"]
        time.sleep(0.2)
    for _ in range(50):  # the server writes through a temporary file: read a whole one
        try:
            executed = nbformat.read(saved, as_version=4)
            break
        except Exception:
            time.sleep(0.2)
    else:
        return ["the saved notebook could not be read"]
    return nbtools.differences(nbformat.read(nb, as_version=4), executed)


def execute_without_browser(nb: Path, workdir: Path) -> list[str]:
    """No Chromium: run the notebook with nbclient (in a copy of the course) and report
    its errors and its checked outputs that differ, so every chapter is still executed and
    compared; the browser's own checks are reported as not run."""
    import nbformat

    from edu3d.course import nbtools

    root = workdir / "course"
    if not root.exists():
        course_copy(root)
    path = root / nb.relative_to(ROOT)
    executed = nbformat.read(path, as_version=4)
    saved = os.environ.get("EDU3D_SOLUTIONS")
    os.environ.setdefault("EDU3D_SOLUTIONS", "1")
    try:
        nbtools.notebook_client(executed, timeout=int(CELL_TIMEOUT_S), kernel_name="python3",
                                allow_errors=True,
                                resources={"metadata": {"path": str(path.parent)}}).execute()
    finally:
        if saved is None:
            os.environ.pop("EDU3D_SOLUTIONS", None)
    return nbtools.errors(executed) + nbtools.differences(nbformat.read(nb, as_version=4),
                                                          executed)


def check_notebook(page, lab: Lab, nb: Path, out_dir: Path, console: list,
                   shots: bool = True) -> dict:
    rel = nb.relative_to(ROOT).as_posix()
    console.clear()
    phases, mark = {}, time.monotonic()

    def phase(name: str) -> None:
        nonlocal mark
        phases[name] = round(time.monotonic() - mark, 1)
        mark = time.monotonic()

    open_notebook(page, rel)
    phase("open")
    seconds = run_all(page, rel)
    phase("run")
    settle(page)
    report = page.evaluate(REPORT_JS)
    phase("settle")
    name = f"{nb.parent.name}-{nb.stem}"
    problems = []
    if report["errors"]:
        problems.append(f"error outputs: {report['errors']}")
    if report["widgetErrors"]:
        problems.append(f"{report['widgetErrors']} 'Error displaying widget'")
    empty = [p for p in report["plots"] if not p["traces"] or not p["points"] or
             not p["title"] or p["height"] < 50]
    if empty:
        problems.append(f"empty or untitled charts: {empty}")
    if shots:
        screenshot_whole(page, out_dir / f"{name}.png")  # as the learner first sees it
        phase("screenshot")
    turned = None
    if report["controls"]:
        console_before = len(console)
        turned = turn_every_panel(page)
        for t in turned:
            if t["failed"]:
                problems.append(f"panel {t['panel']} ({t['title']!r}): {t['failed'][:5]}")
            if not t["changed"]:
                problems.append(f"panel {t['panel']} ({t['title']!r}): none of its "
                                f"{t['positions']} control positions changed it")
        errors = console_errors(console[console_before:])
        if errors:
            problems.append(f"console errors while turning the controls: {errors[:5]}")
        del console[console_before:]  # checked here
        report = page.evaluate(REPORT_JS)
        if report["errors"]:
            problems.append(f"error outputs after turning the controls: {report['errors']}")
        phase("control")
    problems += [f"checked output differs from the committed one: {d}"
                 for d in compare_saved(page, lab, nb, rel)]
    phase("save")
    errors = console_errors(console)
    if errors:
        problems.append(f"console errors: {errors[:5]}")
    return {"notebook": rel, "seconds": round(seconds, 1), "plots": len(report["plots"]),
            "widgets": report["widgets"], "controls": report["controls"],
            "turned": turned and sum(t["positions"] for t in turned), "phases": phases,
            "slowest": turned and sorted((x for t in turned for x in t["slowest"]),
                                         reverse=True)[:3],
            "problems": problems}


class Session:
    """One JupyterLab server and one headless Chromium page for many notebooks."""

    def __init__(self, workdir: Path, out_dir: Path, shots: bool = True):
        from playwright.sync_api import sync_playwright

        self.out_dir, self.shots = out_dir, shots
        out_dir.mkdir(parents=True, exist_ok=True)
        self.lab = Lab(course_copy(workdir / "course"), workdir)
        self.results: list[dict] = []
        self.console: list = []
        try:
            self._pw = sync_playwright().start()
            self.browser = self._pw.chromium.launch(executable_path=CHROMIUM,
                                                    args=CHROMIUM_ARGS)
        except Exception:
            self.lab.close()
            raise
        self.page = self.browser.new_context(
            viewport=VIEWPORT).new_page()
        self.page.on("console", lambda m: self.console.append(
            {"type": m.type, "text": m.text[:300]}))
        self.page.on("pageerror", lambda e: self.console.append(
            {"type": "pageerror", "text": str(e)[:300], "stack": (e.stack or "")[:1500]}))
        try:
            load_app(self.page, self.lab)
        except Exception:
            self.close()
            raise

    def check(self, nb: Path) -> dict:
        try:
            result = check_notebook(self.page, self.lab, nb, self.out_dir, self.console,
                                    self.shots)
        finally:
            start = time.monotonic()
            try:
                close_notebook(self.page)
            finally:
                shutdown_kernels(self.lab)  # one kernel at a time on a 2-core machine
            closing = round(time.monotonic() - start, 1)
        result["phases"]["close"] = closing
        self.results.append(result)
        (self.out_dir / "report.json").write_text(json.dumps(self.results, indent=1))
        print(json.dumps(result), flush=True)
        return result

    def close(self) -> None:
        try:
            self.browser.close()
            self._pw.stop()
        finally:
            self.lab.close()


def browse(notebooks: list[Path], workdir: Path, out_dir: Path) -> list[dict]:
    session = Session(workdir, out_dir)
    try:
        for nb in notebooks:
            session.check(nb)
    finally:
        session.close()
    return session.results


def shutdown_kernels(lab: Lab) -> None:
    req = urllib.request.Request(f"{lab.url}/api/kernels?token={TOKEN}")
    with urllib.request.urlopen(req, timeout=10) as r:
        kernels = json.load(r)
    for k in kernels:
        urllib.request.urlopen(urllib.request.Request(
            f"{lab.url}/api/kernels/{k['id']}?token={TOKEN}", method="DELETE"), timeout=30)


def session_fixture(tmp_path_factory, label: str):
    """The browser session for one test file (module scope), or None where Chromium or
    Playwright is missing (said loudly; a failure when ``EDU3D_REQUIRE_BROWSER=1``)."""
    reason = _missing()
    if reason:
        _not_run(reason, "the notebooks are executed with nbclient instead\n")
        yield None
        return
    work = tmp_path_factory.mktemp(f"browser-{label}")
    shots = os.environ.get("EDU3D_SCREENSHOTS")
    out_dir = Path(shots) / label if shots else work / "report"
    s = Session(work, out_dir, shots=bool(shots))
    yield s
    s.close()
    print(f"\n{'screenshots' if shots else 'report'} in {out_dir}; seconds per notebook "
          "(all cells, in the browser):")
    for r in s.results:
        print(f"{r['seconds']:6.1f} s  {r['notebook']}: {r['plots']} charts, "
              f"{r['widgets']} widget views, control positions turned: {r['turned']}; "
              f"phases (s): {r['phases']}")
    print(f"{sum(r['seconds'] for r in s.results):6.1f} s  in total")


def check_or_execute(session, nb: Path, tmp_path_factory) -> dict | None:
    """Check ``nb`` in the browser; without one, execute it with nbclient and compare."""
    if session is None:
        problems = execute_without_browser(nb, tmp_path_factory.getbasetemp() / "nbclient")
        assert not problems, "\n".join(problems)
        warnings.warn(f"{nb.name}: executed with nbclient; browser checks NOT run")
        return None
    r = session.check(nb)
    assert not r["problems"], "\n".join(r["problems"])
    return r


def check_chapter(session, nb: Path, tmp_path_factory) -> None:
    """A chapter checked (:func:`check_or_execute`): with a browser, it also drew a chart and
    has a control panel."""
    r = check_or_execute(session, nb, tmp_path_factory)
    if r is not None:
        assert r["plots"], f"{r['notebook']} drew no chart"
        assert r["controls"], f"{r['notebook']} has no control panel (.edu3d-controls)"


def main(argv: list[str]) -> int:
    import tempfile

    chosen = [ROOT / a for a in argv] or NOTEBOOKS
    work = Path(tempfile.mkdtemp(prefix="edu3d-browser-"))
    found = browse(chosen, work, Path(os.environ.get("EDU3D_SCREENSHOTS") or work / "shots"))
    print(f"screenshots in {work}")
    print(f"{sum(r['seconds'] for r in found):6.1f} s of Run All in total")
    return 1 if any(r["problems"] for r in found) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
