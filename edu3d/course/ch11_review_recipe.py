"""Chapter 11's one-page recipe: the planner's own decisions, read from its code.

After reading this file you should know how to find a good configuration the way the
Ultra-Scale Playbook ends ("fit one replica, scale to the target batch, then optimise
throughput") and that ``edu3d plan`` is that recipe:

* :func:`decisions` reads the source of :func:`edu3d.plan.search.candidates` and
  :func:`edu3d.plan.search.search` (Python's ``ast``) and returns each choice the planner
  makes (a loop: ``tp in divisors(cl.gpus)``), each candidate it skips (a guard:
  ``spec.n_heads % tp``), the fit test and the ranking, in the order it takes them, each
  tied to its step of the recipe and to the chapter that teaches it. Change the planner
  and the flowchart changes with it: nothing is copied by hand;
* :func:`plan_command` runs ``edu3d plan`` (a real process, the learner's command line) and
  returns what it printed, so the recipe's commands show their real output.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap

from edu3d.plan import search as planner

#: the recipe's three steps (the Playbook's), in order
STEPS = ("1 · fit one replica", "2 · scale to the target batch", "3 · optimise throughput")
#: which step and chapter a planner variable belongs to
TOPICS = {"tp": (0, "04"), "pp": (0, "05"), "cp": (0, "13"), "zero": (0, "03"),
          "rec": (0, "07"), "fits": (0, "07"), "dp": (1, "02"), "ep": (1, "12"),
          "b": (1, "05"), "m": (1, "05"), "experts": (1, "12"), "eps": (1, "12"),
          "rank": (2, "10")}


def _source(fn) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


def _topic(code: str) -> str:
    """The planner variable a line of its code is about (the first one named in it)."""
    head = code.split(" in ")[0] if " in " in code and "=" not in code else code
    names = [n.id for n in ast.walk(ast.parse(head)) if isinstance(n, ast.Name)]
    return next((n for n in names if n in TOPICS), "dp")


def _walk(body, out: list[dict]) -> None:
    for node in body:
        if isinstance(node, ast.For):
            for target, it in (zip(node.target.elts, node.iter.elts)
                               if isinstance(node.target, ast.Tuple) and
                               isinstance(node.iter, ast.Tuple) else
                               [(node.target, node.iter)]):
                out.append({"kind": "choose", "code": f"{ast.unparse(target)} in "
                                                      f"{ast.unparse(it)}"})
            _walk(node.body, out)
        elif isinstance(node, ast.If) and isinstance(node.body[0], ast.Continue):
            out.append({"kind": "skip", "code": ast.unparse(node.test)})
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            out.append({"kind": "set", "code": ast.unparse(node)})
        elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Yield):
            out.append({"kind": "yield", "topic": "fits", "code": "yield setup(dp, tp, pp, zero, m, b, recompute, ep, cp)"})
        elif hasattr(node, "body"):
            _walk(node.body, out)


def decisions() -> list[dict]:
    """The planner's decisions in its own order: ``{"kind", "code", "step", "chapter"}``;
    kinds: ``choose`` (a loop over options), ``skip`` (a guard that drops a candidate),
    ``set`` (a value derived from the choices), ``fit`` and ``rank`` (the search's test and
    order)."""
    out: list[dict] = []
    _walk(_source(planner.candidates).body, out)
    found = {}
    for node in ast.walk(_source(planner.search)):
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant)]
            if "fits" in keys:
                found["fit"] = ast.unparse(node.values[keys.index("fits")])
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "sort":
            found["rank"] = "sort by " + ast.unparse(node.keywords[0].value.body)
    out += [{"kind": k, "topic": {"fit": "fits"}.get(k, k), "code": found[k]}
            for k in ("fit", "rank")]
    for d in out:
        topic = d.get("topic") or _topic(d["code"])
        d["step"], d["chapter"] = TOPICS[topic]
    return out


def cluster_defaults() -> str:
    """The values the fit test's names take by default (``edu3d plan``'s cluster)."""
    cl = planner.Cluster(1)
    return (f"cl.usable = {cl.usable:g}, cl.gpu_mem_gb = {cl.gpu_mem_gb:g}, "
            f"GB = {planner.GB:g}; CP_MIN_TOKENS = {planner.CP_MIN_TOKENS}")


def plan_command(*argv: str, lines: int | None = None) -> str:
    """Run ``edu3d plan ARGV`` as the learner would and return what it printed (its first
    ``lines`` lines), preceded by the command."""
    done = subprocess.run([sys.executable, "-m", "edu3d.cli", "plan", *argv],
                          capture_output=True, text=True, timeout=120)
    text = (done.stdout + done.stderr).rstrip().splitlines()
    shown = text if lines is None else text[:lines] + (["..."] if len(text) > lines else [])
    return "\n".join([f"$ edu3d plan {' '.join(argv)}", *shown])
