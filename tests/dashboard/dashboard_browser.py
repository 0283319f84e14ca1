"""Opening the dashboard in Debian's chromium through Playwright (never a downloaded browser)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from playwright.async_api import Page, async_playwright

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def chromium_available() -> bool:
    """Whether the system browser is installed."""
    return Path(CHROMIUM).exists() or shutil.which("chromium") is not None


async def wait_loaded(page: Page, *, timeout_ms: float = 15_000) -> None:
    """Wait until the page has rendered at least one snapshot."""
    await page.wait_for_selector("body[data-loaded='true']", timeout=timeout_ms)


async def open_dashboard(url: str, screenshot: Path, *, width: int = 1440, height: int = 900,
                         query: str = "", check: Any = None) -> None:
    """Open ``url``/dashboard, wait for data, run ``await check(page)`` if given, and save a
    full-page screenshot to ``screenshot``."""
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = await browser.new_page(viewport={"width": width, "height": height})
            await page.goto(f"{url}/dashboard{query}")
            await wait_loaded(page)
            # One more poll, so the charts were drawn at their final size with fresh data.
            await page.wait_for_timeout(2500)
            if check is not None:
                await check(page)
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(screenshot), full_page=True)
        finally:
            await browser.close()
