"""The web dashboard (`cubicle serve` at /dashboard/) in a real headless browser: Debian's
`chromium` (scripts/install-deps.sh installs it) driven by Playwright (PyPI, pinned in
tests/e2e/requirements.txt) with that executable — Playwright's own browser download is
never used.

What a user does: log in with an API key; see a sandbox made with the SDK (template,
metadata, state); watch its CPU and memory charts and its logs; type a command into the
browser terminal (xterm.js over envd's PTY API) and see its output; pause and kill from
the buttons (the SDK then sees it paused / gone); list templates and API keys.

Screenshots go to a temporary directory (printed; made when the first dashboard test
runs), removed after a run in which every test passed; set CUBICLE_E2E_SCREENSHOTS to keep
them somewhere else. The tests check what the screenshots show where a user would look:
the terminal's picture is not blank and shows text, the charts have drawn their series.
"""

from __future__ import annotations

import base64
import re
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from e2b import Sandbox, SandboxQuery, SandboxState
from playwright.sync_api import Browser, Page, expect, sync_playwright

from conftest import API_KEY, API_URL, FAST_TEMPLATE, KEY_B, TEMPLATE, Tracker, api, poll, unique

CHROMIUM = os.environ.get("CUBICLE_E2E_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
KEEP_SHOTS = os.environ.get("CUBICLE_E2E_SCREENSHOTS")
# Set by the `browser` fixture (not at import: a run that selects no dashboard test would
# leave an empty temporary directory behind).
SHOTS = Path(KEEP_SHOTS or ".")
DASHBOARD = f"{API_URL}/dashboard/"
# Series colours of chart.js (CPU, memory).
CPU_RGB, MEM_RGB = (0x2F, 0x6F, 0xDE), (0x1F, 0x8A, 0x4C)


@pytest.fixture(scope="module")
def browser(request: pytest.FixtureRequest) -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} missing: run scripts/install-deps.sh (Debian's chromium)"
    global SHOTS
    SHOTS = Path(KEEP_SHOTS or tempfile.mkdtemp(prefix="cubicle-dashboard-"))
    SHOTS.mkdir(parents=True, exist_ok=True)
    print(f"dashboard screenshots: {SHOTS}")
    with sync_playwright() as p:
        # Playwright runs chromium without its setuid sandbox (--no-sandbox) by default,
        # which it needs as root.
        b = p.chromium.launch(executable_path=CHROMIUM)
        try:
            yield b
        finally:
            b.close()
    # The temporary screenshots are evidence only when something failed.
    if not KEEP_SHOTS and request.session.testsfailed == 0:
        shutil.rmtree(SHOTS, ignore_errors=True)


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    ctx = browser.new_context(viewport={"width": 1280, "height": 1000})
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # Kill and revoke ask for confirmation: a user clicks OK.
    pg.on("dialog", lambda d: d.accept())
    try:
        yield pg
    finally:
        ctx.close()
    assert not errors, f"uncaught errors in the dashboard: {errors}"


def log_in(page: Page, key: str = API_KEY) -> None:
    page.goto(DASHBOARD)
    page.fill("#api-key", key)
    page.click("#login")
    expect(page.locator("#team")).to_be_visible()


def shot(page: Page, name: str, selector: str | None = None) -> bytes:
    path = SHOTS / f"{name}.png"
    png = (page.locator(selector) if selector else page).screenshot(path=str(path))
    assert path.stat().st_size > 0
    return png


def pixels(page: Page, png: bytes, rgb: tuple[int, int, int] | None = None) -> dict:
    """Decodes a screenshot in the page itself: its size, how many pixels differ from its
    first (background) pixel, and how many are close to `rgb`."""
    return page.evaluate(
        """async ([b64, rgb]) => {
            const img = new Image();
            img.src = 'data:image/png;base64,' + b64;
            await img.decode();
            const c = document.createElement('canvas');
            c.width = img.width; c.height = img.height;
            const g = c.getContext('2d');
            g.drawImage(img, 0, 0);
            const d = g.getImageData(0, 0, c.width, c.height).data;
            let differ = 0, near = 0;
            for (let i = 0; i < d.length; i += 4) {
                if (d[i] !== d[0] || d[i + 1] !== d[1] || d[i + 2] !== d[2]) differ++;
                if (rgb && Math.abs(d[i] - rgb[0]) < 40 && Math.abs(d[i + 1] - rgb[1]) < 40 && Math.abs(d[i + 2] - rgb[2]) < 40) near++;
            }
            return { width: c.width, height: c.height, differ, near };
        }""",
        [base64.b64encode(png).decode(), list(rgb) if rgb else None],
    )


def sandbox_state(sid: str) -> str | None:
    r = api("GET", f"/sandboxes/{sid}")
    return r.json()["state"] if r.status_code == 200 else None


def test_login_refuses_a_wrong_key_and_accepts_a_right_one(page: Page):
    page.goto(DASHBOARD)
    page.fill("#api-key", "e2b_" + "0" * 40)
    page.click("#login")
    expect(page.locator("#flash")).to_contain_text("refused")
    expect(page.locator("#team")).to_have_count(0)
    page.fill("#api-key", API_KEY)
    page.click("#login")
    team = api("GET", "/cubicle/whoami").json()["team"]
    expect(page.locator("#team")).to_have_text(team)
    expect(page).to_have_url(f"{DASHBOARD}#/sandboxes")


def test_list_shows_an_sdk_sandbox_and_pause_and_kill_work(page: Page, sandboxes: Tracker):
    tag = unique()
    sbx = sandboxes.create(FAST_TEMPLATE, metadata={"dashboard": tag}, timeout=300)
    sid = sbx.sandbox_id
    log_in(page)
    row = page.locator(f'#sandboxes tr[data-id="{sid}"]')
    expect(row).to_be_visible()
    cells = row.locator("td")
    expect(cells.nth(1)).to_have_text(FAST_TEMPLATE)
    expect(cells.nth(2)).to_have_text("running")
    expect(row.locator(".meta")).to_have_text([f"dashboard={tag}"])
    shot(page, "sandboxes")

    row.locator('button[data-action="pause"]').click()
    assert poll(lambda: sandbox_state(sid) == "paused", timeout=60), sandbox_state(sid)
    paused = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED], metadata={"dashboard": tag})).next_items()
    assert [s.sandbox_id for s in paused] == [sid]
    expect(cells.nth(2)).to_have_text("paused", timeout=15_000)
    expect(row.locator('button[data-action="resume"]')).to_be_visible()

    row.locator('button[data-action="kill"]').click()
    expect(row).to_have_count(0, timeout=15_000)
    assert api("GET", f"/sandboxes/{sid}").status_code == 404
    left = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING, SandboxState.PAUSED], metadata={"dashboard": tag}))
    assert not left.next_items()


def test_detail_charts_logs_and_terminal(page: Page, sandboxes: Tracker):
    sbx = sandboxes.create(TEMPLATE, metadata={"dashboard": unique()}, timeout=300)
    sid = sbx.sandbox_id
    # A line in the sandbox's log: its network audit trail records the name it looks up.
    line = f"dashboard-log-{unique()}.example.com"
    sbx.commands.run(f"getent hosts {line} || true")
    # Some CPU for the chart.
    sbx.commands.run("timeout 3 sh -c 'while :; do :; done' || true")
    log_in(page)
    page.goto(f"{DASHBOARD}#/sandboxes/{sid}")
    expect(page.locator("h1.mono")).to_have_text(sid)
    expect(page.locator("#facts")).to_contain_text(TEMPLATE)

    # Charts: samples arrive every 5 s; the series is drawn in its colour.
    expect(page.locator("#cpu-chart")).to_have_attribute("data-samples", re.compile(r"^[2-9]|^\d\d"), timeout=30_000)
    for canvas, rgb in (("#cpu-chart", CPU_RGB), ("#mem-chart", MEM_RGB)):
        p = pixels(page, shot(page, f"chart-{canvas[1:]}", canvas), rgb)
        assert p["differ"] > 200 and p["near"] > 20, f"{canvas}: {p}"
    expect(page.locator("#mem-now")).to_contain_text("MiB of")

    expect(page.locator("#logs")).to_contain_text(line, timeout=20_000)

    # Terminal: a shell over the PTY API; the command's output appears on the screen.
    page.click("#open-terminal")
    expect(page.locator("#terminal")).to_have_attribute("data-state", "connected", timeout=20_000)
    marker = unique()
    page.locator("#terminal").click()
    page.keyboard.type(f"echo out-{marker}")
    page.keyboard.press("Enter")

    def screen() -> list[str]:
        return page.evaluate(
            """() => { const b = window.cubicleTerminal.buffer.active; const out = [];
                       for (let i = 0; i < b.length; i++) out.push(b.getLine(i).translateToString(true));
                       return out; }"""
        )

    lines = poll(lambda: [l for l in screen() if l.strip() == f"out-{marker}"] and screen(), timeout=20)
    assert lines, f"no output line in the terminal: {screen()}"
    assert any(f"echo out-{marker}" in l for l in lines), lines
    p = pixels(page, shot(page, "terminal", "#terminal"))
    assert p["width"] > 300 and p["height"] > 100, p
    assert p["differ"] > 500, f"the terminal's screenshot is blank: {p}"
    page.click("#close-terminal")
    shot(page, "detail")


def test_templates_and_keys_pages_list_what_exists(page: Page):
    log_in(page)
    page.goto(f"{DASHBOARD}#/keys")
    keys = api("GET", "/cubicle/api-keys").json()
    assert any(API_KEY.startswith(k["prefix"]) for k in keys)
    for k in keys:
        expect(page.locator(f'#keys tr[data-prefix="{k["prefix"]}"] td').nth(1)).to_have_text(k["team"])
    # The other team's key (run.sh makes one) is there, and ours says it is ours.
    assert KEY_B and any(KEY_B.startswith(k["prefix"]) for k in keys)
    mine = next(k for k in keys if API_KEY.startswith(k["prefix"]))
    expect(page.locator(f'#keys tr[data-prefix="{mine["prefix"]}"]')).to_contain_text("active (yours)")
    shot(page, "keys")

    page.goto(f"{DASHBOARD}#/templates")
    # The node's templates (GET /default-templates) and the team's own (E2B's GET /templates).
    listed = api("GET", "/default-templates").json() + api("GET", "/templates").json()
    names = {a for t in listed for a in t["aliases"]}
    assert {"base", "tiny"} <= names, names
    for t in listed:
        expect(page.locator(f'#template-list tr[data-id="{t["templateID"]}"]')).to_be_visible()
    pools = api("GET", "/cubicle/pool").json()
    for name in pools["target"]:
        expect(page.locator(f'#pools tr[data-template="{name}"]')).to_be_visible()
    shot(page, "templates")
