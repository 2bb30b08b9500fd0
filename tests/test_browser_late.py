"""The second half of the chapters (07-13) in a real browser: the same checks as
``tests/test_browser.py`` (chapters 00-06), in a file of its own so that the two
pytest-xdist workers share the chapters. The machinery: ``tests/browser.py``."""

import pytest

from tests import browser

LATE = browser.CHAPTERS[browser.EARLY:]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    yield from browser.session_fixture(tmp_path_factory, "chapters-late")


@pytest.mark.timeout(browser.CELL_TIMEOUT_S + 300)  # + every control turned
@pytest.mark.parametrize("nb", LATE, ids=lambda p: p.stem)
def test_chapter_renders_in_chromium(session, nb, tmp_path_factory):
    """A chapter: no error output, every chart drawn with a title, control panels whose
    every control redraws without an error, checked outputs as committed."""
    browser.check_chapter(session, nb, tmp_path_factory)
