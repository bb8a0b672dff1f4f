"""The dashboard in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`) driven by
Selenium loads /dashboard from a real server under load, with the API key in the URL fragment. It loads with
no console errors, draws one cell per KV block, and the blocks it shows held agree with /metrics."""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
import time

import httpx
import pytest

from tests.engine.tiny_llama_dir import build_tiny_llama_dir
from tests.entrypoints.server_helpers import RemoteServer

selenium = pytest.importorskip("selenium", reason="the browser test needs selenium (the dev extra)")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402

CHROMEDRIVER = shutil.which("chromedriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
KEY = "sk-browser"
NUM_BLOCKS = 40

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (CHROMEDRIVER and CHROMIUM), reason="needs chromium and chromium-driver")]


@pytest.fixture
def browser():
    profile = tempfile.mkdtemp(prefix="pagedllm-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={profile}", "--window-size=1280,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def used_blocks_on_metrics(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return int(float(re.search(r'pagedllm_kv_cache_blocks\{model_name="tiny",state="used"\} (\S+)', text).group(1)))


def test_the_page_draws_the_pool_under_load(tmp_path, browser):
    model_dir = build_tiny_llama_dir(tmp_path / "model")
    # blocks of 64: a request's block count changes only every 64 tokens, so the page and a scrape can agree
    srv = RemoteServer(model_dir, ["--enable-dashboard", "--api-key", KEY, "--served-model-name", "tiny",
                                   "--num-kv-blocks", str(NUM_BLOCKS), "--block-size", "64", "--max-model-len", "1024"],
                       tmp_path / "server.log")
    stop = threading.Event()

    def load():
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as client:
            while not stop.is_set():
                client.post(f"{srv.url}/v1/completions", json={
                    "model": "tiny", "prompt": [9] * 100, "max_tokens": 600, "ignore_eos": True, "n": 2})

    workers = [threading.Thread(target=load) for _ in range(2)]
    try:
        for w in workers:
            w.start()
        browser.get(f"{srv.url}/dashboard#key={KEY}")
        assert "key=" not in browser.current_url  # the page took the key out of the address bar
        deadline = time.monotonic() + 90
        agreed = None
        while time.monotonic() < deadline and agreed is None:
            # Within one update: the page's count lies between two scrapes taken around reading it (the map
            # and /metrics are published at different moments while the load moves the count).
            before = used_blocks_on_metrics(srv.url)
            grid = browser.execute_script("""const c = document.querySelector('canvas.grid');
                return c && c.dataset.numBlocks ? [+c.dataset.numBlocks, +c.dataset.numUsed] : null;""")
            after = used_blocks_on_metrics(srv.url)
            if grid is not None:
                assert grid[0] == NUM_BLOCKS  # one cell per KV block
                if grid[1] > 0 and min(before, after) <= grid[1] <= max(before, after):
                    agreed = grid[1]
            time.sleep(0.3)
        assert agreed, f"the page never showed the blocks /metrics reported; log:\n{srv.log()}"
        rows = browser.execute_script("return document.querySelectorAll('.running tr').length")
        assert rows >= 2  # a header and at least one running request
        browser.save_screenshot(str(tmp_path / "dashboard.png"))
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        stop.set()
        for w in workers:
            w.join()
        srv.stop()


def test_the_page_shows_the_disk_tier(tmp_path, browser):
    model_dir = build_tiny_llama_dir(tmp_path / "model")
    srv = RemoteServer(model_dir, ["--enable-dashboard", "--served-model-name", "tiny", "--num-kv-blocks", "24",
                                   "--block-size", "16", "--max-model-len", "1024", "--max-num-seqs", "1",
                                   "--kv-disk-cache", str(tmp_path / "kv")], tmp_path / "server.log")
    try:
        prefix = [9 + i % 300 for i in range(160)]
        for prompt in [prefix + [5] * 8] + [[400 + j] * 120 for j in range(4)] + [prefix + [6] * 8]:
            httpx.post(f"{srv.url}/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 2}).raise_for_status()
        hits = srv.wait_idle_without_leaks()["pagedllm_kv_disk_cache_hit_tokens_total"]
        assert hits >= 160
        browser.get(f"{srv.url}/dashboard")
        deadline, row = time.monotonic() + 30, None
        while time.monotonic() < deadline and row is None:
            row = browser.execute_script("""for (const tr of document.querySelectorAll('#totals tr'))
                if (tr.cells[0].textContent.startsWith('prompt tokens: memory / disk')) return tr.cells[1].textContent;
                return null;""")
            time.sleep(0.3)
        assert row is not None and int(row.split(" / ")[1]) == hits, row
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
    finally:
        srv.stop()
