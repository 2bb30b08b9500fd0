"""Exercise 05 (pipeline schedule, missing 1/m): the reference solution is right and the stubs
are stubs. The notebook itself is graded both ways by tests/test_grading.py."""

from __future__ import annotations

import pytest

from edu3d.course import grading
from edu3d.schedules import Action, check, one_f_one_b, with_comms
from edu3d.course.ch05_pipeline_parallel_grade import gradients


def test_solution_schedule_is_megatrons_1f1b():
    sol = grading.load("pp_schedule", solutions=True)
    for pp in range(1, 6):
        for m in range(1, 10):
            got = [[Action.parse(a) for a in ops] for ops in sol.one_f_one_b(pp, m)]
            assert got == one_f_one_b(pp, m)
            check(with_comms(got, pp), pp, m)


def test_solution_gradient_check_and_fix():
    sol = grading.load("pp_schedule", solutions=True)
    assert sol.gradient_scale(*gradients(m=4, scale_loss=False)) == pytest.approx(4.0, rel=1e-5)
    assert sol.gradient_scale(*gradients(m=4)) == pytest.approx(1.0, rel=1e-5)
    pipe, serial = gradients(m=4, microbatch_loss=sol.microbatch_loss)
    assert max(float((pipe[n] - serial[n]).norm() / serial[n].norm()) for n in serial) < 1e-5


def test_stubs_raise_with_hints():
    stub = grading.load("pp_schedule", solutions=False)
    for call in (lambda: stub.one_f_one_b(2, 2), lambda: stub.microbatch_loss(1.0, 2),
                 lambda: stub.gradient_scale({}, {})):
        with pytest.raises(NotImplementedError, match="hint"):
            call()
