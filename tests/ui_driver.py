"""Driving the Dagster UI in headless Chromium (Selenium), for tests/test_ui_browser.py.

The browser and its driver are Debian's `chromium` and `chromium-driver` packages
(/usr/bin/chromium, /usr/bin/chromedriver): nothing is downloaded at run time (Selenium Manager
is never asked, since the driver's path is given). chromedriver runs in its own process group,
so that stopping it also ends every Chromium process it started, whatever state the page is in.

Every wait names what it waits for, and polls an explicit condition up to a generous timeout
(a loaded 2-core machine renders the UI slowly); nothing sleeps a fixed time.
"""

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

# The flags that work on a container without a display, GPU or network, as root.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                  "--hide-scrollbars", "--force-device-scale-factor=1", "--lang=en-US"]


def browser_missing() -> str | None:
    """Why the browser cannot run here, or None when it can."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    if missing:
        return (f"{', '.join(missing)} not found: install Debian's chromium and "
                "chromium-driver packages (apt-get install chromium chromium-driver)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


class Browser:
    """Headless Chromium on a fresh profile; `with Browser(profile_dir) as page:`."""

    def __init__(self, profile_dir: Path, width: int = 1600, height: int = 1000,
                 log_path: Path | None = None):
        self.profile_dir, self.width, self.height = Path(profile_dir), width, height
        self.log_path = log_path or self.profile_dir.with_suffix(".chromedriver.log")
        self.driver = None
        self.service = None

    def __enter__(self) -> "Page":
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.profile_dir.mkdir(parents=True, exist_ok=True)
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={self.profile_dir}",
                     f"--window-size={self.width},{self.height}"]:
            options.add_argument(flag)
        self.service = Service(executable_path=CHROMEDRIVER, log_output=str(self.log_path),
                               popen_kw={"start_new_session": True})
        try:
            self.driver = webdriver.Chrome(service=self.service, options=options)
            self.driver.set_page_load_timeout(120)
            self.driver.set_script_timeout(60)
        except BaseException:
            self.close()
            raise
        return Page(self.driver)

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.driver is not None:
            with contextlib.suppress(Exception):
                self.driver.quit()
            self.driver = None
        process = getattr(self.service, "process", None) if self.service else None
        if process is not None:  # chromedriver's group: itself and the Chromium it started
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(Exception):
                process.wait(10)


class Page:
    """One tab of the UI, with the few gestures the tests need."""

    def __init__(self, driver):
        self.driver = driver
        self.base_url = ""

    # -- navigation and waiting ---------------------------------------------------------------

    def open(self, path: str) -> None:
        self.driver.get(self.base_url + path)

    def wait(self, condition: Callable[[], object], what: str, timeout: float = 120.0,
             every: float = 0.5):
        """Poll `condition` until it returns something truthy (returned); a TimeoutError names
        `what` and the last error the condition raised."""
        deadline = time.monotonic() + timeout
        last_error = None
        while True:
            try:
                value = condition()
                if value:
                    return value
            except Exception as err:  # stale elements, a page still rendering
                last_error = err
            if time.monotonic() >= deadline:
                raise TimeoutError(f"waited {timeout:.0f}s for {what} on {self.url}"
                                   + (f" (last error: {last_error!r})" if last_error else ""))
            time.sleep(every)

    @property
    def url(self) -> str:
        return self.driver.current_url

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    # -- finding things -----------------------------------------------------------------------

    def visible(self, xpath: str) -> list:
        from selenium.webdriver.common.by import By

        return [e for e in self.driver.find_elements(By.XPATH, xpath) if e.is_displayed()]

    def visible_text(self, text: str) -> list:
        """Visible elements whose own text is exactly `text` (after trimming)."""
        return self.visible(f"//*[normalize-space(text())={_xpath_literal(text)}]")

    def visible_containing(self, fragment: str) -> list:
        """Visible elements whose own text contains `fragment`."""
        return self.visible(f"//*[contains(normalize-space(text()), {_xpath_literal(fragment)})]")

    def wait_text(self, text: str, timeout: float = 120.0):
        """The first visible element whose own text is `text`, once there is one."""
        return self.wait(lambda: (self.visible_text(text) or [None])[0],
                         f"the text {text!r}", timeout)

    def button(self, label: str):
        """A visible, enabled button labelled `label`, or None."""
        for element in self.visible(f"//button[normalize-space(.)={_xpath_literal(label)}]"):
            if element.is_enabled() and element.get_attribute("aria-disabled") != "true":
                return element
        return None

    def tab(self, label: str):
        """A visible tab (role="tab", as the asset page's Overview | Partitions | ... tabs)
        labelled `label`, or None; the navigation sidebar's links of the same names are not
        tabs."""
        found = self.visible(f"//*[@role='tab'][normalize-space(.)={_xpath_literal(label)}]")
        return found[0] if found else None

    def click(self, label: str, timeout: float = 120.0) -> None:
        """A real click (a pointer event through the browser) on the button `label`."""
        self._click(lambda: self.button(label), f"a clickable button {label!r}", timeout)

    def click_tab(self, label: str, timeout: float = 120.0) -> None:
        """A real click on the tab `label`; returns once it is the selected tab."""
        self._click(lambda: self.tab(label), f"the tab {label!r}", timeout)
        self.wait(lambda: self.tab(label).get_attribute("aria-selected") == "true",
                  f"the tab {label!r} selected", timeout)

    def _click(self, find, what: str, timeout: float) -> None:
        element = self.wait(find, what, timeout)
        self.js("arguments[0].scrollIntoView({block: 'center'})", element)
        element.click()

    # -- the launchpad's config editor (CodeMirror) -------------------------------------------

    def editor_text(self) -> str | None:
        return self.js("const e = document.querySelector('.CodeMirror');"
                       "return e && e.CodeMirror ? e.CodeMirror.getValue() : null;")

    def set_editor_text(self, text: str) -> None:
        """Replace the launchpad's YAML with `text` through the editor's own API (what typing
        does, without the editor's auto-indent rewriting pasted YAML)."""
        self.js("const cm = document.querySelector('.CodeMirror').CodeMirror;"
                "cm.focus(); cm.setValue(arguments[0]); cm.setCursor(cm.lineCount(), 0);", text)

    # -- the asset graph ----------------------------------------------------------------------

    def graph_nodes_in_view(self, names: list[str]) -> bool:
        """Whether a node labelled with each of `names` is drawn inside the graph's viewport
        (not clipped at its edges)."""
        return self.js("""
            const names = arguments[0];
            const labels = Array.from(document.querySelectorAll('svg foreignObject *'));
            return names.every(name => {
              const el = labels.find(e => Array.from(e.childNodes).some(
                c => c.nodeType === 3 && c.textContent.trim() === name));
              if (!el) return false;
              // The graph's viewport: the panel that holds the graph and its zoom controls.
              const zoom = document.getElementById('zoom-slider-container');
              if (!zoom) return false;
              const box = zoom.parentElement.getBoundingClientRect();
              const r = el.getBoundingClientRect();
              return r.width > 0 && r.left >= box.left && r.right <= box.right
                && r.top >= box.top && r.bottom <= box.bottom;
            });""", names)

    def zoom_graph_to_show(self, names: list[str], max_clicks: int = 15) -> None:
        """Click the graph's zoom-out button until every node in `names` is in view."""
        for _ in range(max_clicks):
            if self.graph_nodes_in_view(names):
                return
            self._click(lambda: (self.visible("//button[.//*[@aria-label='zoom_out']]")
                                 or [None])[0], "the graph's zoom-out button", 30)
            with contextlib.suppress(TimeoutError):  # the zoom animates; poll, then go on
                self.wait(lambda: self.graph_nodes_in_view(names), "the zoomed graph", 2.0,
                          every=0.25)
        if not self.graph_nodes_in_view(names):
            raise AssertionError(f"the asset graph does not show all of {names} even after "
                                 f"{max_clicks} zoom-outs")

    # -- artifacts ----------------------------------------------------------------------------

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not self.driver.save_screenshot(str(path)):
            raise RuntimeError(f"could not save a screenshot to {path}")
        return path

    def scroll_to(self, element, block: str = "start") -> None:
        self.js(f"arguments[0].scrollIntoView({{block: '{block}'}})", element)

    def series_pixels(self) -> list[int]:
        """For each chart canvas on the page, how many of its pixels are drawn in the series
        colour (Dagster's accent blue-violet); a chart without a line has none."""
        return self.js("""
            return Array.from(document.querySelectorAll('canvas'))
              .filter(c => c.width > 50 && c.height > 50 && c.offsetParent !== null)
              .map(c => {
                const data = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let n = 0;
                for (let i = 0; i < data.length; i += 4) {
                  const [r, g, b, a] = [data[i], data[i + 1], data[i + 2], data[i + 3]];
                  if (a > 128 && b > 150 && b - r > 60 && b - g > 80) n++;
                }
                return n;
              });""")


def copy_screenshots(shots: dict[str, Path], dest: Path, prefix: str = "ui_") -> list[Path]:
    """Copy each screenshot to dest/<prefix><name>.png (the README's images)."""
    dest.mkdir(parents=True, exist_ok=True)
    out = []
    for name, src in shots.items():
        target = dest / f"{prefix}{name}.png"
        shutil.copyfile(src, target)
        out.append(target)
    return out


def _xpath_literal(text: str) -> str:
    if "'" not in text:
        return f"'{text}'"
    if '"' not in text:
        return f'"{text}"'
    parts = text.split("'")
    return "concat(" + ", \"'\", ".join(f"'{p}'" for p in parts) + ")"
