"""Every exercise notebook in a real browser (JupyterLab + headless Chromium), with the
solutions in place: executed once, its checks as committed, rendered without errors. The
machinery and what is checked: ``tests/browser.py``; the chapters: ``tests/test_browser.py``
and ``tests/test_browser_late.py`` (files of their own, so that the two pytest-xdist workers
share them)."""

import pytest

from tests import browser


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    yield from browser.session_fixture(tmp_path_factory, "exercises")


@pytest.mark.timeout(browser.CELL_TIMEOUT_S + 120)
@pytest.mark.parametrize("nb", browser.EXERCISES, ids=lambda p: p.stem)
def test_exercise_renders_in_chromium(session, nb, tmp_path_factory):
    """An exercise: no error output or widget error, checked outputs as committed."""
    browser.check_or_execute(session, nb, tmp_path_factory)
