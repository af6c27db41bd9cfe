"""The documentation site: it builds with warnings as errors, its generated reference pages cover the code, its
examples run as written, and its Quickstart page renders in a real (headless) browser with no broken link.

The code blocks, in ``README.md`` and every ``docs/**/*.md``: each ``python`` block that is a script (it has the
``if __name__ == "__main__":`` guard a Dask script needs) runs in a fresh interpreter, in a scratch directory; the
Quickstart's ``bash`` blocks run in order, in one scratch directory, as a newcomer types them. Both use the demo's
model (``dask_lm.demo_model()``, built once into this session's ``DASK_LM_CACHE_DIR``, which conftest.py sets and
the subprocesses inherit) with ``HF_HUB_OFFLINE=1``: nothing is downloaded. Fragments (no guard) are not run.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import http.server
import os
import pathlib
import re
import subprocess
import sys
import threading
import typing
import urllib.parse
from html.parser import HTMLParser

import pytest
from helpers import launch_chromium
from site_build import DOCS, SITE_BUILD, SiteBuild

ROOT = pathlib.Path(__file__).resolve().parents[1]
GUARD = 'if __name__ == "__main__":'
# the pages whose scripts run: a script that lost its guard (and so silently became a fragment) fails the test
# that lists them, so this suite cannot pass by finding nothing
PAGES_WITH_SCRIPTS = ["README.md", "docs/guides/policy.md", "docs/guides/scoring.md"]


def _blocks(path: pathlib.Path, lang: str) -> list[str]:
    if not path.exists():  # a page that is gone has no blocks: the test that lists them fails, not the collection
        return []
    return re.findall(rf"^```{lang}\n(.*?)^```$", path.read_text(), flags=re.S | re.M)


def _scripts() -> list[tuple[str, str]]:
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [(str(p.relative_to(ROOT)), block) for p in pages for block in _blocks(p, "python") if GUARD in block]


SCRIPTS = _scripts()
QUICKSTART_BASH = _blocks(DOCS / "quickstart.md", "bash")


def _env() -> dict[str, str]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "DASK_LM_PROGRESS": "0",
        # `dask-lm` and `python` as a newcomer's activated virtual environment has them
        "PATH": os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
    }
    env.pop("DASK_SCHEDULER_ADDRESS", None)  # each example starts its own local cluster, as on a laptop
    return env


# ------------------------------------------------------------------------------------------------ the build
@pytest.fixture(scope="module")
def site(request):
    """One build of the site for the whole session: ``(exit code, sphinx's output, the HTML directory)``. The suite
    starts it when it collects a test that asks for it (tests/conftest.py), so it runs beside the tests before."""
    build = request.config.stash.get(SITE_BUILD, None)
    if build is None:  # collected without the conftest hook's knowledge
        build = request.config.stash[SITE_BUILD] = SiteBuild()
    return build.result(timeout=600)


def test_the_site_builds_with_warnings_as_errors(site):
    code, log, out = site
    assert code == 0, f"sphinx-build -W failed:\n{log[-6000:]}"
    for page in (
        "index",
        "quickstart",
        "guides/index",
        "reference/index",
        "reference/cli",
        "reference/api",
        "reference/output",
        "reference/exit-codes",
        "reference/config",
        "benchmarks",
        "internals/index",
    ):
        assert (out / f"{page}.html").is_file(), page


class _Page(HTMLParser):
    """The ids, ``<a href>`` targets and table rows of one built page (stdlib parser: no dependency)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.hrefs: list[str] = []
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        if tag == "a" and a.get("href") is not None:
            self.hrefs.append(a["href"])
        if tag == "tr":
            self.rows.append([])
        if tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self.rows:
            self.rows[-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)


def _parse(path: pathlib.Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    return page


def test_every_internal_link_on_every_page_resolves(site):
    _, _, out = site
    pages = {p: _parse(p) for p in out.rglob("*.html")}
    assert len(pages) >= 15, sorted(pages)
    broken = []
    for path, page in pages.items():
        for href in page.hrefs:
            parts = urllib.parse.urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith(("mailto:", "javascript:")):
                continue  # external: not checked (no network), and none is needed to read the site
            target = (path.parent / urllib.parse.unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file() or out.resolve() not in target.parents:
                broken.append(f"{path.relative_to(out)}: {href} (no such file)")
                continue
            fragment = urllib.parse.unquote(parts.fragment)
            if fragment and target.suffix == ".html" and fragment not in pages[target].ids:
                broken.append(f"{path.relative_to(out)}: {href} (no element with id {fragment!r})")
    assert not broken, "\n".join(broken)


# ------------------------------------------------------------------------------- the generated reference pages
def _config_fields(cls: type, prefix: str) -> list[tuple[str, dataclasses.Field]]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.metadata.get('key', f.name)}"
        out.append((key, f))
        inner = [t for t in (hints[f.name], *typing.get_args(hints[f.name])) if dataclasses.is_dataclass(t)]
        if inner:
            out += _config_fields(inner[0], key)
    return out


def test_the_config_page_lists_every_key_with_its_default(site):
    from dask_lm.config import PolicyConfig

    _, _, out = site
    rows = {r[0]: r for r in _parse(out / "reference" / "config.html").rows if r and r[0].startswith("policy.")}
    fields = _config_fields(PolicyConfig, "policy")
    assert len(fields) > 80 and sorted(rows) == sorted(k for k, _ in fields)
    for key, f in fields:
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )
        if not dataclasses.is_dataclass(default) and key != "policy.model_name":
            # JSON spellings, as a YAML or dict config writes them
            expected = (
                {None: "null", True: "true", False: "false"}.get(default, default)
                if isinstance(default, (bool, type(None)))
                else default
            )
            assert rows[key][2].replace('"', "") == str(expected).replace("'", ""), (key, rows[key])
    assert rows["policy.model_name"][2] == "required"
    assert rows["policy.generation.top_p"][1:3] == ["float", "1.0"]
    assert rows["policy.precision"][1] == '"float32" | "bfloat16" | "float16"'
    assert rows["policy.dtensor_cfg._v2"][1] == "bool"  # NeMo RL's spelling, not the attribute's
    assert rows["policy.tokenizer.name"][3].startswith("Tokenizer path or id; defaults to model_name.")
    # a key dask-lm refuses says so, from the table the config check itself uses
    assert "refused when > 1" in rows["policy.dtensor_cfg.tensor_parallel_size"][3]


def test_the_api_page_documents_every_public_name(site):
    import dask_lm
    import dask_lm.errors

    _, _, out = site
    ids = _parse(out / "reference" / "api.html").ids
    expected = {f"dask_lm.{n}" for n in dask_lm.__all__ if n != "__version__"}
    expected |= {f"dask_lm.errors.{n}" for n in dask_lm.errors.__all__ if n not in dask_lm.__all__}
    assert expected <= ids, sorted(expected - ids)


def test_the_cli_page_has_every_command_and_option(site):
    from dask_lm.cli import main

    _, _, out = site
    text = " ".join(html.unescape("".join(_parse(out / "reference" / "cli.html").text)).split())
    assert len(main.commands) >= 4
    for name, command in main.commands.items():
        assert f"dask-lm {name}" in text, name
        for param in command.params:
            for opt in param.opts if param.param_type_name == "option" else []:
                assert opt in text, (name, opt)


# -------------------------------------------------------------------------------------------- the code blocks
def test_the_pages_have_their_scripts_and_the_quickstart_its_commands():
    # scoring, the Policy / training: the tests below must not pass by finding nothing
    assert sorted({page for page, _ in SCRIPTS}) == PAGES_WITH_SCRIPTS, [page for page, _ in SCRIPTS]
    assert len(SCRIPTS) <= 6  # each starts a local cluster (~15 s on 2 cores): one per guide at most
    commands = "\n".join(QUICKSTART_BASH)
    assert "dask-lm demo" in commands and "dask-lm score" in commands and "read_scores" in commands


@pytest.mark.cluster
@pytest.mark.parametrize("page,script", SCRIPTS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(SCRIPTS)])
def test_a_script_runs_as_written(page, script, tmp_path):
    (tmp_path / "example.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{page}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert done.stdout.strip(), f"{page}: the script printed nothing"
    # a clean end: no nanny killing a worker that was slow to exit, no traceback, no logged WARNING (a script that
    # still holds Policy futures as the interpreter exits included: connect()'s close at exit closes the client
    # before distributed's hook closes the cluster, which would warn of the computed tasks it loses)
    assert "still alive after" not in done.stderr and "Traceback" not in done.stderr, f"{page}:\n{done.stderr[-6000:]}"
    assert "WARNING" not in done.stderr, f"{page}:\n{done.stderr[-6000:]}"
    # every job the script started finished: each output folder it made (a manifest) holds its _SUCCESS
    jobs = [m.parent for m in tmp_path.rglob("_manifest.json")]
    assert all((j / "_SUCCESS").exists() for j in jobs), jobs


@pytest.mark.cluster
def test_the_quickstart_commands_run_in_order(tmp_path):
    import pyarrow.parquet as pq

    for i, block in enumerate(QUICKSTART_BASH):
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"quickstart block {i}:\n{block}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    # the newcomer's own file was scored whole: every row of it is in the output, once
    inputs = [p for p in tmp_path.glob("*.parquet")]
    assert len(inputs) == 1 and (tmp_path / "scores" / "_SUCCESS").exists()
    scored = pq.read_table(tmp_path / "scores").column("id").to_pylist()
    assert sorted(scored) == sorted(pq.read_table(inputs[0]).column("id").to_pylist())


# ------------------------------------------------------------------------------------------------ the browser
class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no request log lines in pytest's output
        pass


def _colours(png: pathlib.Path) -> int:
    from PIL import Image

    with Image.open(png) as image:
        return len(image.convert("RGB").getcolors(maxcolors=1 << 24) or [])


def test_the_quickstart_page_renders_with_its_navigation_in_a_browser(site):
    from playwright.sync_api import sync_playwright

    _, _, out = site
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(out)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    artifacts = pathlib.Path(os.environ.get("DASK_LM_TEST_ARTIFACTS") or ROOT / "test-artifacts")
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / "docs-quickstart.png"
    try:
        with sync_playwright() as p:
            browser = launch_chromium(p)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"http://127.0.0.1:{server.server_address[1]}/quickstart.html", wait_until="load")
                title = page.title()
                heading = page.locator("h1").first
                heading.wait_for(state="visible", timeout=30_000)
                heading_text = heading.inner_text()
                links = page.eval_on_selector_all(
                    "a[href]",
                    """els => els.map(a => ({
                    text: a.innerText.trim(), href: a.getAttribute('href'),
                    visible: !!(a.offsetWidth || a.offsetHeight || a.getClientRects().length)}))""",
                )
                page.screenshot(path=str(shot))
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()
    print(f"\nquickstart screenshot: {shot}")
    assert title.startswith("Quickstart") and heading_text.startswith("Quickstart"), (title, heading_text)
    visible = {(link["text"], link["href"]) for link in links if link["visible"]}
    assert ("Guides", "guides/index.html") in visible and ("Reference", "reference/index.html") in visible, visible
    # a rendered page, not a blank one: text, the theme's colours and anti-aliasing give thousands of colours
    assert shot.stat().st_size > 20_000 and _colours(shot) > 200, (shot.stat().st_size, _colours(shot))
