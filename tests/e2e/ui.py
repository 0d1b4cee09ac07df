"""The Prefect UI walked in headless Debian chromium (playwright): a flow run's page, its task
runs and every artifact, with what each showed and every console error or failed request."""

from __future__ import annotations

import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
#: The Prefect 3.8 UI asks for an icon named "undefined" for each progress artifact in the run
#: graph (a UI bug, not our data); every other failed request or console error fails the test.
KNOWN_UI_NOISE = ("/ico/undefined.svg",)


def browse(server, flow_run, artifacts, shots: Path) -> dict:
    """Visit the flow run, its train task run and every artifact; return what was seen."""
    from playwright.sync_api import sync_playwright

    shots.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    seen: dict = {"artifacts": []}
    args = [
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    ]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=args)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.on(
            "console",
            lambda m: (
                problems.append(f"console: {m.text}")
                if m.type == "error" and "Failed to load resource" not in m.text
                else None
            ),
        )
        page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
        noise: list[str] = []
        page.on(
            "response",
            lambda r: (
                (noise if any(k in r.url for k in KNOWN_UI_NOISE) else problems).append(
                    f"{r.status} {r.url}"
                )
                if r.status >= 400
                else None
            ),
        )
        page.goto(f"{server['ui']}/runs/flow-run/{flow_run.id}", wait_until="networkidle")
        page.get_by_text("finalize", exact=False).first.wait_for(timeout=30000)
        seen["run_page"] = page.inner_text("body")
        page.screenshot(path=str(shots / "flow-run.png"), full_page=True)
        page.get_by_text("Task Runs", exact=True).first.click()
        page.wait_for_timeout(1500)
        seen["task_runs_tab"] = page.inner_text("body")
        page.screenshot(path=str(shots / "task-runs.png"), full_page=True)
        seen["known_noise"] = list(noise)
        for artifact in artifacts:
            page.goto(f"{server['ui']}/artifacts/artifact/{artifact.id}", wait_until="networkidle")
            page.get_by_text(artifact.key).first.wait_for(timeout=30000)
            page.wait_for_timeout(500)
            images = page.eval_on_selector_all(
                "img[src^='data:image/png']", "els => els.map(e => e.complete && e.naturalWidth)"
            )
            links = page.eval_on_selector_all(
                "a[href^='file://'], a[href^='s3://']",
                "els => els.map(e => e.getAttribute('href'))",
            )
            seen["artifacts"].append(
                {
                    "key": artifact.key,
                    "text": page.inner_text("body"),
                    "images": images,
                    "links": links,
                }
            )
            page.screenshot(
                path=str(shots / f"{artifact.key}-{artifact.id.hex[:6]}.png"), full_page=True
            )
        browser.close()
    seen["problems"] = problems
    return seen
