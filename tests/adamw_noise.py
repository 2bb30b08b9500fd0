"""How far float rounding may move a weight, a loss and a gradient norm through AdamW steps.

A layout computes the serial model's gradients in another summation order, so every gradient
entry carries rounding noise; the parity tests' gradient checks bound it: each tensor's
gradient is within ``tol`` (1e-5) of the serial one, relative, so the noise has an RMS of at
most ``tol`` x the RMS of that tensor's gradient (measured: 1e-7 to 5e-7 x, whatever the
CPU's vector width).

AdamW turns a gradient into the update ``lr * m̂ / (sqrt(v̂) + eps)``. A gradient change
``δ`` moves that by about ``lr * |δ| / (sqrt(v̂) + eps)`` through ``m̂`` (whose bias-corrected
weights sum to 1, so it carries the noise of earlier steps too), and at most as much again
through ``v̂``. Where ``sqrt(v̂)`` is large against the noise the move is tiny; where an
entry's gradients have all been near zero (``sqrt(v̂)`` at the noise, or under AdamW's
``eps`` = 1e-8) the same noise moves the entry by up to ``lr`` a step, whatever the layout
got right: the key third of an attention's qkv bias (true gradient exactly 0) and single
entries whose first gradient happens to be ~1e-8 (one expert weight of test_5d_parity's
``dp2 ep2 tp2 zloss``: first gradient 4.8e-9 against an RMS of 9.1e-4, moved 5.5e-5 by
one CPU's summation order against another's). A moved entry then changes the next steps'
gradients of the weights it meets (there, that expert's row of the layer before it, by
1e-5), so the noise spreads.

So the **weights** after AdamW are compared entry by entry (:func:`beyond`), each allowed

* its **slack**, the move that noise the gradient checks accept (``tol``) can cause through
  AdamW at that entry, step by step::

      slack_i += 2 * lr_t * tol * max_{k<=t} rms(g_k) / (sqrt(v̂_{i,t}) + eps)

  (a gradient exactly 0 so far is a sum of zeros in any order, and moves nothing);
* and how far such moves **spread**: a control run of the serial model, whose every entry is
  displaced after each step by that step's slack (in a fixed random direction), ends this
  far from the plain serial run (:func:`serial_and_control`);

and what is left beyond that must stay within ``tol``, relative, as every other comparison.
The **losses and gradient norms** of the AdamW steps are sums over the whole model, which
the control moves in proportion to its noise (measured linear from ``tol`` = 1e-7 to 1e-5):
each may differ from the serial run's by ``tol``, relative, plus the control's difference at
that step scaled to the layout's own measured gradient noise (:func:`beyond_records`).

Everything here derives from ``tol``, from AdamW's formula and from the serial run itself,
never from a number one machine gave: it holds on any CPU and BLAS. It stays far below what a
wrong optimizer does (a missing shard of its state, a doubled weight decay, a stale step count
move every entry by about ``lr``; a weight decay 10 % too strong on one layout exceeds it 7
to 10 times): an entry whose gradient RMS is typical is allowed ``2 * steps * lr * tol`` and
its share of the spread, 2e-6 after 5 steps at lr 3e-3 (the median entry of
test_5d_parity's models).
"""

from __future__ import annotations

import torch


class AdamRecord:
    """Watches the AdamW ``optimizer`` of ``model`` and adds up each entry's slack (see the
    module's docstring) from the gradients it steps on (clipped, as it sees them).
    ``displace=True`` makes this run the control: after each step every entry moves by that
    step's slack, in a direction fixed by ``seed``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, tol: float,
                 displace: bool = False, seed: int = 0):
        self.names = {p: n for n, p in model.named_parameters()}
        self.tol = tol
        self.slack: dict[str, torch.Tensor] = {}
        self._state: dict[str, tuple] = {}  # name -> (v, AdamW steps seen, noise so far)
        self._moves: dict[torch.nn.Parameter, torch.Tensor] = {}
        self._signs = torch.Generator().manual_seed(seed)
        optimizer.register_step_pre_hook(self._before_step)
        if displace:
            optimizer.register_step_post_hook(self._after_step)

    def _before_step(self, optimizer, args, kwargs) -> None:
        self._moves = {}
        for group in optimizer.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                name, g = self.names[p], p.grad.detach().double()
                v, count, noise = self._state.get(name, (0.0, 0, 0.0))
                beta2, count = group["betas"][1], count + 1
                v = beta2 * v + (1 - beta2) * g * g
                noise = max(noise, self.tol * float(g.pow(2).mean().sqrt()))
                move = 2 * group["lr"] * noise / ((v / (1 - beta2 ** count)).sqrt() + group["eps"])
                move = move * (v > 0)  # gradients exactly 0 so far: sums of zeros, no noise
                self._state[name] = (v, count, noise)
                self.slack[name] = self.slack.get(name, 0.0) + move
                self._moves[p] = move

    @torch.no_grad()
    def _after_step(self, optimizer, args, kwargs) -> None:
        for p, move in self._moves.items():
            sign = torch.randint(0, 2, p.shape, generator=self._signs) * 2 - 1
            p.add_((sign * move).to(p.dtype))


def serial_and_control(build, train, tol: float) -> dict:
    """The serial AdamW run and its control: ``build()`` makes a fresh ``(model, optimizer)``,
    ``train(model, optimizer)`` runs the steps and returns their records. Returns the plain
    run's ``records`` and ``final`` weights, the control's ``control`` records, each weight's
    ``allowed`` move (its slack plus how far the control ended from the plain run; a
    parameter AdamW never stepped is allowed nothing), and the ``tol`` they are for."""
    runs = []
    for displace in (False, True):
        model, optimizer = build()
        watch = AdamRecord(model, optimizer, tol, displace=displace)
        records = train(model, optimizer)
        runs.append((records, {n: p.detach().clone() for n, p in model.named_parameters()},
                     watch.slack))
    (records, final, slack), (control, moved, _) = runs
    allowed = {n: slack.get(n, 0.0) + (moved[n].double() - w.double()).abs()
               for n, w in final.items()}
    return {"records": records, "final": final, "control": control, "allowed": allowed,
            "tol": tol}


def beyond(got: torch.Tensor, ref: torch.Tensor, allowed: torch.Tensor | float) -> float:
    """The part of ``got - ref`` that no entry's allowance explains, relative to ``ref``."""
    ref = ref.double()
    excess = ((got.double() - ref).abs() - allowed).clamp_min(0)
    return float(excess.norm() / ref.norm().clamp_min(1e-12))


def beyond_records(ours: list[dict], run: dict, grad_err: float,
                   keys=("loss", "grad_norm")) -> float:
    """The worst relative difference of ``keys`` between ``ours`` and the serial ``run``
    (:func:`serial_and_control`'s), step by step, beyond the control's own difference at that
    step scaled to the layout's gradient noise: its measured gradient error ``grad_err``
    against the control's ``tol``."""
    scale = grad_err / run["tol"]
    return max(max(0.0, abs(a[k] - b[k]) - scale * abs(c[k] - b[k])) / abs(b[k])
               for a, b, c in zip(ours, run["records"], run["control"], strict=True)
               for k in keys)


def without_key_bias(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t``, with the key third of an attention's qkv bias set to 0. That bias adds the same
    ``q·b_k`` to every score of a query, which softmax cancels: its true gradient is exactly
    0, so what any run computes there is rounding noise (a slack covers it, unless the serial
    run's noise there happened to be exactly 0). Compared after AdamW steps, it is left out:
    its value is not a result of the data."""
    if not name.endswith("attn.qkv.bias"):
        return t
    t = t.clone()
    third = t.shape[0] // 3
    t[third:2 * third] = 0
    return t
