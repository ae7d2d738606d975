"""The rollout viewer (nanorl/viewer.py) in a real headless browser, and its handling of hostile text.

- a dump of a real run on the built-in task renders with no console error, one element per sample
  and per token, sorting and colouring work, and a screenshot is saved (tests/artifacts/viewer.png);
- rollout text is untrusted: `<script>`, `<img onerror>`, `</textarea>`, `</script>` and U+2028 payloads
  in prompts, responses, token pieces and reward names are shown as text; nothing runs (no global
  set, no console error) and no element is injected (the page's element set is exactly its own).

The browser is Chromium with chromedriver (Debian: `apt-get install -y chromium chromium-driver`),
driven by selenium. Without them the browser tests skip — unless NANORL_REQUIRE_BROWSER=1 (CI, .ci/run
installs them), where a missing browser fails.

Run: python -m pytest tests/test_viewer.py -q
"""
import json
import os
import shutil
from pathlib import Path

import pytest

import train
from nanorl import viewer

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
PAYLOADS = ['<script>window.__pwned = 1</script>', '<img src=x onerror="window.__pwned = 2">',
            '</textarea><svg onload="window.__pwned = 3">', '</script><script>window.__pwned = 4</script>',
            '\u2028\u2029 "q" &amp; <!-- ', "<style>body{display:none}</style>"]


def find_browser():
    """(chromium, chromedriver) paths, or a reason why not."""
    binary = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")
                   if shutil.which(b)), None)
    driver = shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return None, "selenium is not installed (pip install -r requirements.txt)"
    if not binary or not driver:
        return None, ("Chromium or chromedriver not found (Debian: apt-get install -y chromium "
                      "chromium-driver)")
    return (binary, driver), ""


@pytest.fixture(scope="module")
def browser():
    found, why = find_browser()
    if found is None:
        if os.environ.get("NANORL_REQUIRE_BROWSER") == "1":
            pytest.fail(f"NANORL_REQUIRE_BROWSER=1 but no browser: {why}")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = found[0]
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1200,800"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(found[1]), options=opts)  # a local binary: no driver download
    yield driver
    driver.quit()


def load(driver, page: Path) -> list:
    """Open the page; return its console messages of level SEVERE (errors, CSP violations)."""
    driver.get_log("browser")  # drop what an earlier page left
    driver.get(page.as_uri())
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def count(driver, selector: str) -> int:
    return driver.execute_script("return document.querySelectorAll(arguments[0]).length", selector)


def test_json_block_cannot_be_closed():
    text = viewer.safe_json({"s": PAYLOADS})
    assert not any(c in text for c in "<>&\u2028\u2029")
    assert json.loads(text) == {"s": PAYLOADS}
    with pytest.raises(ValueError, match="no samples"):
        viewer.render([], "empty.jsonl")


@pytest.fixture(scope="module")
def real_dump(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    train.main(["--out-dir", str(out), "--steps", "2", "--prompts-per-step", "4", "--samples-per-prompt", "4",
                "--eval-every", "0", "--eval-limit", "8", "--pass-k", "2", "--threads", "1", "--quiet",
                "--dump-rollouts", "2"])
    return out / "rollouts" / "step_000002.jsonl"


def test_real_dump_renders_in_the_browser(browser, real_dump, tmp_path):
    page, png = viewer.write(str(real_dump), str(tmp_path / "view.html"))
    assert png is not None and Path(png).stat().st_size > 1000  # the run's curves, beside the page
    recs = [json.loads(x) for x in open(real_dump)]
    assert not load(browser, Path(page))
    assert count(browser, ".sample") == len(recs) == 16
    assert count(browser, ".tok") == sum(len(r["tokens"]["id"]) for r in recs)
    assert count(browser, ".group") == len({r["group"] for r in recs}) == 4
    assert count(browser, "img.curves") == 1 and count(browser, "script[src], link") == 0  # nothing external
    coloured = browser.execute_script(
        "return [...document.querySelectorAll('.tok')].filter(t => t.style.backgroundColor).length")
    assert coloured > 0  # entropy colours tokens
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    Select(browser.find_element(By.ID, "sort")).select_by_value("reward-desc")
    Select(browser.find_element(By.ID, "field")).select_by_value("advantage")
    first = browser.find_element(By.CSS_SELECTOR, ".sample .badge b").text  # "reward 1.00"
    assert float(first.split()[1]) == pytest.approx(max(r["reward"] for r in recs))
    tok = browser.find_element(By.CSS_SELECTOR, ".tok")
    from selenium.webdriver import ActionChains
    ActionChains(browser).move_to_element(tok).perform()
    tip = browser.find_element(By.ID, "tip").text
    assert "advantage" in tip and "trainer_logprob" in tip
    Select(browser.find_element(By.ID, "sort")).select_by_value("index")
    Select(browser.find_element(By.ID, "field")).select_by_value("entropy")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "viewer.png"
    browser.save_screenshot(str(shot))
    print(f"screenshot: {shot}")
    assert shot.stat().st_size > 10_000
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def hostile_records() -> list[dict]:
    recs = []
    for i, p in enumerate(PAYLOADS):
        pieces = [p, "ok", p[::-1]]
        recs.append({"step": p, "index": i, "group": i % 2, "prompt": f"{p} prompt",
                     "response": "".join(pieces),
                     "reward": 0.5 * i, "reward_components": {p: 1.0}, "status": p, "weight_version": p,
                     "tokens": {"id": [7, 8, 9], "text": pieces, "rollout_logprob": [-0.1, -0.2, -0.3],
                                "trainer_logprob": [-0.1, -0.25, -0.3], "entropy": [0.1, 1.0, 2.0],
                                "advantage": [1.0, -1.0, 0.0], "loss_mask": [1, 0, 1]}})
    return recs


def test_hostile_text_is_shown_not_run(browser, tmp_path):
    dump = tmp_path / "rollouts" / "step_000001.jsonl"
    dump.parent.mkdir()
    dump.write_text("".join(json.dumps(r) + "\n" for r in hostile_records()))
    page, png = viewer.write(str(dump), str(tmp_path / "hostile.html"))
    assert png is None  # no metrics.jsonl beside the rollouts folder
    assert not load(browser, Path(page))
    from selenium.webdriver import ActionChains
    from selenium.webdriver.common.by import By
    for tok in browser.find_elements(By.CSS_SELECTOR, ".tok")[:6]:  # hovering renders a piece too
        ActionChains(browser).move_to_element(tok).perform()
    assert browser.execute_script("return window.__pwned") is None
    tags = set(browser.execute_script("return [...document.querySelectorAll('*')].map(e => "
                                      "e.tagName.toLowerCase())"))
    assert tags <= {"html", "head", "meta", "title", "style", "body", "header", "h1", "div", "label",
                    "select",
                    "option", "span", "main", "section", "b", "br", "script"}, tags
    assert count(browser, "script") == 2 and count(browser, "style") == 1  # the page's own, no more
    assert count(browser, "[onerror], [onload]") == 0
    text = browser.execute_script("return document.body.textContent")
    assert all(p.strip() in text for p in PAYLOADS[:4]) and "<style>body{display:none}</style>" in text
    assert count(browser, ".tok") == 3 * len(PAYLOADS)
    assert not [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
