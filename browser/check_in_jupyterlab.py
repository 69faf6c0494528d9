"""The course as a learner sees it, in a real browser (`make browser-test`; README, "Developing").

JupyterLab serves a copy of the repository on 127.0.0.1 (a random port, a token) and headless Chromium
(the system's, /usr/bin/chromium, driven by Playwright) opens every lesson and finds no error output; runs
lesson 1, changes the planner's model and sees a new verdict within 2 s; saves, restarts the kernel,
reopens and still sees the planner (with JupyterLab's default settings, then with the widget manager's
`saveState` on); opens and saves lesson 2 and finds the file unchanged; follows a link into
docs/references.md and finds its heading in view. Every wait is bounded. Not part of `make test`: it
takes minutes, and CI's 20 minutes are spent already.
"""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from playwright.sync_api import expect, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
LESSONS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
WIDGETS_SETTINGS = "@jupyter-widgets/jupyterlab-manager:plugin"
NOTEBOOK_SETTINGS = "@jupyterlab/notebook-extension:tracker"  # every cell rendered, not only those in view


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"no Chromium at {CHROMIUM}: apt-get install chromium, or set CHROMIUM to its path")
    root = tmp_path_factory.mktemp("course")
    for folder in ("notebooks", "docs"):
        shutil.copytree(ROOT / folder, root / folder)
    port, token = _free_port(), secrets.token_hex(16)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter",
            "lab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--allow-root",
            f"--LabApp.user_settings_dir={root / '.settings'}",
            f"--LabApp.workspaces_dir={root / '.workspaces'}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                server.kill()
                pytest.fail("JupyterLab did not start within 90 s")
            time.sleep(1)
    lab = {"base": base, "token": token, "root": root}
    _api(lab, "PUT", f"/lab/api/settings/{NOTEBOOK_SETTINGS}", {"raw": json.dumps({"windowingMode": "none"})})
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(60_000)
        yield {**lab, "page": page}
        browser.close()
    server.terminate()
    server.wait(timeout=30)


def _api(lab, method, path, body=None):
    request = urllib.request.Request(
        f"{lab['base']}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"token {lab['token']}"},
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.read()


def _open(lab, path):
    page = lab["page"]
    page.goto(f"{lab['base']}/lab/tree/{path}?reset&token={lab['token']}")
    page.locator(".jp-Notebook .jp-Cell").first.wait_for(timeout=90_000)
    page.wait_for_timeout(3_000)  # outputs and widgets render
    return page


def _shut_down_kernels(lab):
    for session in json.loads(_api(lab, "GET", "/api/sessions")):
        _api(lab, "DELETE", f"/api/sessions/{session['id']}")


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_lesson_opens_without_error_outputs(lab, lesson):
    page = _open(lab, f"notebooks/{lesson}")
    assert page.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').count() == 0
    assert "Error displaying widget" not in page.locator(".jp-Notebook").inner_text()
    assert page.locator(".jp-OutputArea-output .ansi-red-fg, .jp-OutputArea-output.jp-mod-error").count() == 0
    _shut_down_kernels(lab)


def _run_planner_save_and_reopen(lab):
    page = _open(lab, "notebooks/01_adam_memory.ipynb")
    page.locator(".jp-Notebook").click()
    page.keyboard.press("Escape")
    page.get_by_text("Run", exact=True).first.click()
    page.get_by_text("Run All Cells", exact=True).click()
    model = page.locator(".widget-dropdown select").first
    expect(page.locator(".jp-RenderedMarkdown strong", has_text="llama-3.2-1b").first).to_be_visible(timeout=240_000)
    expect(page.locator(".jp-Notebook-cell.jp-mod-running")).to_have_count(0, timeout=240_000)
    model.select_option("llama-3.2-3b")
    expect(page.locator(".jp-RenderedMarkdown strong", has_text="llama-3.2-3b").first).to_be_visible(timeout=2_000)
    page.keyboard.press("Control+s")
    page.wait_for_timeout(3_000)
    _shut_down_kernels(lab)
    page = _open(lab, "notebooks/01_adam_memory.ipynb")
    expect(page.locator(".widget-dropdown select").first).to_be_visible(timeout=30_000)
    assert "Error displaying widget" not in page.locator(".jp-Notebook").inner_text()
    _shut_down_kernels(lab)


def test_the_planner_answers_and_survives_a_save_with_default_settings(lab):
    _run_planner_save_and_reopen(lab)


def test_the_planner_survives_a_save_with_save_state_on(lab):
    _api(lab, "PUT", f"/lab/api/settings/{WIDGETS_SETTINGS}", {"raw": json.dumps({"saveState": True})})
    try:
        _run_planner_save_and_reopen(lab)
    finally:
        _api(lab, "PUT", f"/lab/api/settings/{WIDGETS_SETTINGS}", {"raw": "{}"})


def test_opening_and_saving_lesson_2_changes_nothing(lab):
    path = lab["root"] / "notebooks/02_gradient_accumulation.ipynb"
    before = path.read_text()
    page = _open(lab, "notebooks/02_gradient_accumulation.ipynb")
    page.locator(".jp-Notebook").click()
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + 30
    while path.stat().st_mtime_ns == path.stat().st_ctime_ns and time.monotonic() < deadline:
        page.wait_for_timeout(500)
    page.wait_for_timeout(2_000)
    _shut_down_kernels(lab)
    assert path.read_text() == before


def _heading_after(anchor: str) -> str:
    """The heading that docs/references.md puts right after `<a id="anchor"></a>`."""
    lines = (ROOT / "docs/references.md").read_text().splitlines()
    return lines[lines.index(f'<a id="{anchor}"></a>') + 1].lstrip("#").strip()


def test_a_references_link_lands_on_its_heading(lab):
    page = _open(lab, "notebooks/01_adam_memory.ipynb")
    link = page.locator('.jp-RenderedMarkdown a[href*="references.md"][href*="#"]').first
    anchor = link.get_attribute("href").split("#", 1)[1]
    link.scroll_into_view_if_needed()
    link.click()
    heading = page.locator(".jp-MarkdownViewer").locator("h1, h2, h3, h4", has_text=_heading_after(anchor)).first
    heading.wait_for(timeout=30_000)
    page.wait_for_timeout(2_000)  # the viewer scrolls once rendered
    top = heading.evaluate("e => e.getBoundingClientRect().top")
    assert 0 <= top < 900 / 2, f"the heading of #{anchor} is at {top:.0f} px, not at the top of the view"
    _shut_down_kernels(lab)
