"""The documentation site (mkdocs.yml, docs/) builds with warnings as errors, and its generated pages hold
what they promise: every config field, the Session API, every error class; the README stays short and
every link in it resolves."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from .conftest import REPO


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    print(f"mkdocs build --strict: {time.perf_counter() - t0:.1f}s")
    return out


def page(site, name: str) -> str:
    return (site / name / "index.html").read_text(encoding="utf-8")


def test_the_site_builds_strict_with_config_api_and_errors_pages(site):
    config = page(site, "config")
    for key in ("algo.kl_coef", "model.lora.r", "rollout.n", "train.lr"):
        assert f"<code>{key}</code>" in config, key
    session = page(site, "api/session")
    for method in ("rollout", "score", "prepare", "update", "run", "save", "snapshot", "fork"):  # mixin's too
        assert f'id="rlbench_nb.session.Session.{method}"' in session, method
    assert "ConfigError" in page(site, "errors")
    assert 'id="rlbench_nb.config.ConfigError"' in page(site, "api/errors")


def test_every_config_field_is_on_the_generated_page(site):
    from rlbench_nb.config import all_keys
    config = page(site, "config")
    missing = [key for key in all_keys() if f"<code>{key}</code>" not in config]
    assert not missing, f"config fields missing from docs/config.md's generated tables: {missing}"


def test_every_error_class_is_on_the_errors_page(site):
    names = {m for p in (REPO / "rlbench_nb").rglob("*.py")
             for m in re.findall(r"^class (\w+Error)\(", p.read_text(encoding="utf-8"), re.M)}
    assert "ConfigError" in names and "WorkerError" in names
    errors = page(site, "errors")
    missing = sorted(n for n in names if f"<code>{n}</code>" not in errors)
    assert not missing, f"error classes docs/errors.md does not explain: {missing}"


README_MAX_LINES = 200  # a newcomer reads it in five minutes; every other topic is a page of the site


def test_the_readme_is_short_and_every_link_in_it_resolves():
    """One source for each fact: the README holds the two commands and the first session, and links the rest.
    A link to a file must name one that exists; a link to a docs page must name a page of the site's nav
    (mkdocs.yml), so what the README points at is also on the site."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert len(links) >= 10, links
    nav = (REPO / "mkdocs.yml").read_text(encoding="utf-8")
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        target = link.split("#", 1)[0]
        assert (REPO / target).exists(), f"README.md links to {link}, which does not exist"
        if target.startswith("docs/") and target.endswith(".md"):
            assert f": {target[len('docs/'):]}" in nav, f"README.md links to {target}, which mkdocs.yml's nav lacks"
    for name in re.findall(r"`(notebooks/[\w.]+\.ipynb)`", text):
        assert (REPO / name).exists(), f"README.md names {name}, which does not exist"
