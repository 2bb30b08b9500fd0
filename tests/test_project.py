"""The project's own promises: one set of dependencies, README's test command is CI's."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _requirements_pyproject() -> set[str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    reqs = data["project"]["dependencies"] + data["project"]["optional-dependencies"]["dev"]
    return {r.replace(" ", "") for r in reqs}


def _requirements_environment() -> set[str]:
    text = (ROOT / "environment.yml").read_text()
    pip_block = text.split("- pip:", 1)[1]
    items = re.findall(r"^\s+-\s+(\S+)\s*$", pip_block, re.M)
    return {i for i in items if i not in ("-e", ".")} - {"."}


def test_environment_yml_lists_the_same_packages_as_pyproject():
    env = {r for r in _requirements_environment() if not r.startswith("-e")}
    assert env == _requirements_pyproject()


def test_torch_requirement_admits_2_13():
    torch_req = next(r for r in _requirements_pyproject() if r.startswith("torch"))
    lower = re.search(r">=([\d.]+)", torch_req).group(1)
    assert tuple(map(int, lower.split("."))) <= (2, 13)
    assert "<" not in torch_req or "<2.13" not in torch_req


def test_readme_test_command_is_what_ci_runs():
    """CI runs ./edu3d.sh test, which runs README's test command."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    script = (ROOT / "edu3d.sh").read_text()
    command = re.search(r"```bash\n# test\n(.+?)\n```", readme, re.S).group(1).strip()
    assert command in script
    assert re.search(r"^(EDU3D_\w+=\S+ )*\./edu3d\.sh test$", ci, re.M)
    assert "./edu3d.sh test" in readme


def test_widgets_are_importable_as_edu3d_widgets():
    import edu3d.widgets

    assert Path(edu3d.widgets.__file__).parent == ROOT / "widgets"


def test_notebooks_store_outputs_only_where_nbval_checks_them():
    """nbval compares only executed cells: a checked cell saved without output would pass
    vacuously, and unchecked outputs bloat the repository. An exercise stores no output at
    all: its check cells declare their checks instead (issue 42: no PASS line before the
    learner wrote anything)."""
    import nbformat

    from edu3d.course.nbtools import problems

    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted(
        (ROOT / "exercises").glob("*.ipynb"))
    assert notebooks
    found = {nb.name: problems(nbformat.read(nb, as_version=4)) for nb in notebooks}
    assert not {k: v for k, v in found.items() if v}
    for nb in sorted((ROOT / "exercises").glob("*.ipynb")):
        stored = [i for i, c in enumerate(nbformat.read(nb, as_version=4).cells)
                  if c.cell_type == "code" and c.outputs]
        assert not stored, f"{nb.name}: cells {stored} store outputs"


def test_every_subpackage_is_declared_for_regular_installs():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = set(data["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "edu3d").rglob("__init__.py")}
    on_disk |= {".".join(("edu3d", *p.parent.relative_to(ROOT).parts))  # package-dir widgets/
                for p in (ROOT / "widgets").rglob("__init__.py")}
    assert on_disk == declared


def test_checked_outputs_are_compared_like_nbval():
    """The browser test compares the chapters' checked cells with edu3d.course.nbtools.differences
    (the chapters are executed there, once): a changed printed line is reported, an
    unchecked cell's output and stderr are not."""
    import nbformat

    from edu3d.course import nbtools

    def notebook(printed: str, other: str, stderr: str = ""):
        nb = nbformat.v4.new_notebook()
        checked = nbformat.v4.new_code_cell(f"{nbtools.MARK}\nprint(...)", execution_count=1)
        checked.outputs = [nbformat.v4.new_output("stream", name="stdout", text=printed)]
        if stderr:
            checked.outputs.append(nbformat.v4.new_output("stream", name="stderr",
                                                          text=stderr))
        free = nbformat.v4.new_code_cell("print(...)")
        free.outputs = [nbformat.v4.new_output("stream", name="stdout", text=other)]
        nb.cells = [nbformat.v4.new_markdown_cell("# t"), checked, free]
        return nb

    committed = notebook("PASS a\n", "")
    assert nbtools.differences(committed, notebook("PASS a\n", "12 ms", "progress")) == []
    found = nbtools.differences(committed, notebook("FAIL a\n", ""))
    assert len(found) == 1 and found[0].startswith("cell 1:") and "FAIL a" in found[0]
    assert nbtools.differences(committed, nbformat.v4.new_notebook())
    # an exercise's check cell stores nothing and declares its checks: the run must pass each
    exercise = notebook("", "")
    exercise.cells[1].outputs, exercise.cells[1].execution_count = [], None
    exercise.cells[1].metadata["edu3d"] = {"checks": ["a", "b"]}
    assert not [p for p in nbtools.problems(exercise) if "cell 1: a check cell" in p
                or "declares no check" in p]
    assert nbtools.differences(exercise, notebook("PASS a\nPASS b\n", "", "hint")) == []
    for printed in ("PASS a\n", "PASS b\nPASS a\n", "PASS a\nFAIL b\n"):
        assert nbtools.differences(exercise, notebook(printed, "")), printed


def test_each_panel_is_shown_once():
    """Issue 27 item 2: a cell ends with the panel itself (its figures, which the widget
    replaces once a frontend draws it); no chapter shows a panel's figure in one cell and its
    ``.widget`` in another, which drew every figure twice."""
    import re

    import nbformat

    twice = []
    for nb_path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        for i, cell in enumerate(nb.cells):
            last = cell.source.strip().splitlines()[-1:] if cell.cell_type == "code" else []
            if last and re.match(r"^\w+\.widget\b", last[0]):
                twice.append(f"{nb_path.name} cell {i}: {last[0]}")
    assert not twice, "end the panel's cell with the panel instead:\n" + "\n".join(twice)
