"""The documentation site (mkdocs.yml, docs/) builds with warnings as errors, and its generated pages hold
what they promise: every config field, the Session API, every error class; the tables copied from the
README stay identical to it."""
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


def _table_after(text: str, heading: str) -> list[str] | None:
    """The first markdown table after `heading` (a whole line), as its lines; None without the heading."""
    lines = text.splitlines()
    if heading not in lines:
        return None
    rest = lines[lines.index(heading) + 1:]
    start = next(i for i, line in enumerate(rest) if line.startswith("|"))
    end = next((i for i in range(start, len(rest)) if not rest[i].startswith("|")), len(rest))
    return rest[start:end]


@pytest.mark.parametrize(("readme_heading", "doc", "doc_heading"), [
    ("## Metrics", "metrics.md", "# Metrics"),
    ("### Where each phase lives", "phases.md", "# Phases and workers"),
])
def test_tables_copied_from_the_readme_match_it(readme_heading, doc, doc_heading):
    theirs = _table_after((REPO / "README.md").read_text(encoding="utf-8"), readme_heading)
    if theirs is None:
        pytest.skip(f"the README has no '{readme_heading}' table any more: docs/{doc} is the only copy")
    ours = _table_after((REPO / "docs" / doc).read_text(encoding="utf-8"), doc_heading)
    assert ours == theirs, f"docs/{doc} and the README's '{readme_heading}' table differ: change both"
