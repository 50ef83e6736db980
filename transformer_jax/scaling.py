# Over 600 lines because it is one job read top to bottom: the fit (power laws, the
# compute frontier, the bootstrap) and the report of that fit (plot and table), which
# reads the fit's keys and the reference exponents; split, the two halves would import
# each other's constants.
"""Scaling laws: fit and report the results of a sweep of GPT training runs.

The fitting and reporting half of a scaling-laws study in the style of Kaplan et al. 2020
and Hoffmann et al. 2022 ("Chinchilla"). A sweep writes one result row per member (a
training run: its parameter counts, tokens, FLOPs, final and best eval loss and its eval
curve); this module fits three laws to those rows and writes ``fit.json``, ``scaling.png``
and ``scaling.md``. It is pure post-processing (numpy, scipy and matplotlib; no jax), writing through
:mod:`transformer_jax.storage` (a local directory or a bucket).

Letters: N parameters (non-embedding), D tokens, C training FLOPs, L eval loss (nats per
token), E the irreducible loss.

**The three laws**, each fitted by least squares in loss space (:func:`fit_power_law`)::

    L(N) = E_N + A_N * N ** -alpha_N    size members (group "size"), final eval loss
    L(C) = E_C + A_C * C ** -gamma_C    the compute frontier of all members
    L(D) = E_D + A_D * D ** -beta_D     data members (group "data"), best eval loss
                                        (early stopping) on a training subset of D tokens

and the compute-optimal model size ``N_opt(C) ∝ C ** n_opt``.

**Protocol.** The compute frontier is the lower envelope of every member's eval curve
``L(C)``, read on a log-spaced grid of C (each curve interpolated linearly in log C,
:func:`compute_frontier`). The member attaining the envelope at C "owns" it, and its
non-embedding size is N_opt(C); ``n_opt`` is the least-squares slope of log N_opt against
log C over the grid (:func:`optimal_size_exponent`); where the sweep's smallest (largest)
member owns the frontier's low (high) end only because nothing smaller (larger) was
trained, those plateaus flatten the slope. Each exponent gets a 90% percentile interval
from a residual bootstrap. Because the fits carry an irreducible term E, their
exponents are not comparable with Kaplan's, which have none: the pure power-law slopes
(:func:`loglog_slope`, log L against log x) are reported beside them for that comparison.

**Reference exponents** (:data:`KAPLAN`, :data:`CHINCHILLA`):

* Kaplan et al. 2020, "Scaling Laws for Neural Language Models" (arXiv:2001.08361), pure
  power laws without E (their section 1.2): alpha_N = 0.076 (L(N)), alpha_D = 0.095
  (L(D), called beta_D here), alpha_C^min = 0.050 (L(C_min), the compute-efficient
  frontier, called gamma_C here) and N_opt ∝ C_min^0.73.
* Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models"
  (arXiv:2203.15556): L(N, D) = E + A / N^alpha + B / D^beta with alpha = 0.34,
  beta = 0.28 (approach 3, with an irreducible term E = 1.69), and N_opt ∝ C^0.50
  (approaches 1 and 2; approach 3 gives beta / (alpha + beta) = 0.46). They fit no L(C).

**Outputs** of :func:`analyze`: ``fit.json`` (every exponent, interval, E, A, r², the pure
slopes, the members and the frontier; nan written as null), ``scaling.png`` (three log-log
panels: L(N), L(C) with every curve and the frontier, L(D)) and ``scaling.md`` (a table of
our exponents beside the references).
"""
from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import optimize

from . import storage

__all__ = ["CHINCHILLA", "KAPLAN", "PowerLaw", "analyze", "compute_frontier", "fit_power_law",
           "loglog_slope", "optimal_size_exponent"]

KAPLAN = {"alpha_N": 0.076, "beta_D": 0.095, "gamma_C": 0.050, "n_opt": 0.73}
CHINCHILLA = {"alpha_N": 0.34, "beta_D": 0.28, "n_opt": 0.50}

_E_STARTS = (0.0, 0.5, 0.8, 0.95)    # initial E, as fractions of min(y)
_MAX_EXPONENT = 5.0
_MIN_EXPONENT = 1e-9                 # the exponent is kept strictly positive
_E_MARGIN = 1e-6                     # E <= min(y) * (1 - _E_MARGIN): strictly below min(y)
_COVER_SLACK = 1e-9                  # a curve covers C up to this relative rounding error


# ----------------------------------------------------------------------------- power laws

@dataclass(frozen=True)
class PowerLaw:
    """A fitted ``y = E + A * x ** -exponent`` (E = 0 for a pure power law).

    ``A`` is in the original units of x; ``r2`` = 1 - SS_res / SS_tot of y; ``ci`` the
    bootstrap percentile interval of the exponent ((nan, nan) without a bootstrap); ``n``
    the number of points fitted.
    """
    E: float
    A: float
    exponent: float
    r2: float
    ci: tuple[float, float]
    n: int

    def __call__(self, x):
        """The predicted y = E + A * x ** -exponent (a float for a scalar x)."""
        y = self.E + self.A * np.asarray(x, dtype=float) ** -self.exponent
        return float(y) if np.ndim(y) == 0 else y

    def to_dict(self) -> dict[str, Any]:
        """Plain floats: ``{"E", "A", "exponent", "r2", "ci": [lo, hi], "n"}``."""
        return {"E": float(self.E), "A": float(self.A), "exponent": float(self.exponent),
                "r2": float(self.r2), "ci": [float(self.ci[0]), float(self.ci[1])],
                "n": int(self.n)}


def _check_xy(name: str, x, y, min_points: int) -> tuple[np.ndarray, np.ndarray]:
    """x and y as float arrays, or a ValueError naming what is wrong with them."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.ndim != 1 or y.ndim != 1:
        raise ValueError(f"{name} needs 1-D x and y, got shapes {x.shape} and {y.shape}")
    if x.shape != y.shape:
        raise ValueError(f"{name} needs x and y of the same length, got {len(x)} and {len(y)}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        bad = int(np.sum(~np.isfinite(x)) + np.sum(~np.isfinite(y)))
        raise ValueError(f"{name} needs finite x and y, got {bad} non-finite value(s) (NaN/inf)")
    if np.any(x <= 0):
        raise ValueError(f"{name} needs positive x, got {x[x <= 0][0]!r}")
    if np.any(y <= 0):
        raise ValueError(f"{name} needs positive y (losses), got {y[y <= 0][0]!r}")
    distinct = len(np.unique(x))
    if distinct < min_points:
        raise ValueError(f"{name} needs at least {min_points} points with distinct x, "
                         f"got {distinct}")
    return x, y


def _model(p: np.ndarray, u: np.ndarray, irreducible: bool) -> np.ndarray:
    """E + a * u ** -alpha for p = (E, a, alpha), or a * u ** -alpha for p = (a, alpha)."""
    e, a, alpha = p if irreducible else (0.0, *p)
    return e + a * u ** -alpha


def _jacobian(p: np.ndarray, u: np.ndarray, irreducible: bool) -> np.ndarray:
    """d model / d p: columns (1,) u^-alpha, -a u^-alpha log u."""
    a, alpha = p[-2:]
    power = u ** -alpha
    cols = [power, -a * power * np.log(u)]
    return np.stack(([np.ones_like(u)] if irreducible else []) + cols, axis=1)


def _initial_guess(u: np.ndarray, y: np.ndarray, e0: float) -> tuple[float, float]:
    """(a, alpha) of the straight line log(y - e0) = log a - alpha log u."""
    slope, intercept = np.polyfit(np.log(u), np.log(y - e0), 1)
    return float(np.exp(intercept)), float(np.clip(-slope, 0.01, 0.99 * _MAX_EXPONENT))


def _least_squares(u: np.ndarray, y: np.ndarray, irreducible: bool,
                   starts: Sequence[np.ndarray]) -> tuple[np.ndarray, float] | None:
    """The best (params, cost) over ``starts`` of min sum (model - y)^2 within the bounds
    0 <= E <= min(y) (1 - 1e-6), a >= 0, 1e-9 <= alpha <= 5; None when y is not positive."""
    y_min = float(np.min(y))
    if y_min <= 0:
        return None
    lower = [0.0, 0.0, _MIN_EXPONENT] if irreducible else [0.0, _MIN_EXPONENT]
    upper = ([y_min * (1 - _E_MARGIN)] if irreducible else []) + [np.inf, _MAX_EXPONENT]
    best = None
    for start in starts:
        x0 = np.clip(start, lower, upper)
        result = optimize.least_squares(
            lambda p: _model(p, u, irreducible) - y, x0,
            jac=lambda p: _jacobian(p, u, irreducible), bounds=(lower, upper),
            method="trf", x_scale="jac", ftol=1e-12, xtol=1e-12, gtol=1e-12, max_nfev=500)
        if best is None or result.cost < best[1]:
            best = (result.x, float(result.cost))
    return best


def _starts(u: np.ndarray, y: np.ndarray, irreducible: bool) -> list[np.ndarray]:
    """Initial points: one per E in _E_STARTS * min(y) (just E = 0 for a pure power law)."""
    starts = []
    for fraction in (_E_STARTS if irreducible else (0.0,)):
        e0 = fraction * float(np.min(y))
        a0, alpha0 = _initial_guess(u, y, e0)
        starts.append(np.array([e0, a0, alpha0] if irreducible else [a0, alpha0]))
    return starts


def fit_power_law(x, y, *, irreducible: bool = True, bootstrap: int = 1000,
                  confidence: float = 0.9, seed: int = 0) -> PowerLaw:
    """Least-squares fit of ``y = E + A * x ** -alpha`` (``irreducible=False``: E = 0).

    Minimises sum (y - f(x))^2 (loss space) with 0 <= E < min(y), A >= 0, 0 < alpha <= 5,
    x normalised by its geometric mean, from several initial E (0, 0.5, 0.8, 0.95 of
    min(y)); the best fit is kept. The interval of alpha is a residual bootstrap: refit
    ``bootstrap`` times on fitted + resampled residuals (centred and scaled by
    sqrt(n / (n - p)), p the number of parameters, so that they are not smaller than the
    noise), percentiles (1 -+ confidence) / 2; deterministic for a given ``seed``.
    """
    need = 4 if irreducible else 3
    x, y = _check_xy("fit_power_law", x, y, need)
    if not 0 < confidence < 1:
        raise ValueError(f"fit_power_law needs 0 < confidence < 1, got {confidence}")
    if bootstrap < 0:
        raise ValueError(f"fit_power_law needs bootstrap >= 0, got {bootstrap}")
    scale = float(np.exp(np.mean(np.log(x))))       # geometric mean of x
    u = x / scale
    params, _ = _least_squares(u, y, irreducible, _starts(u, y, irreducible))
    fitted = _model(params, u, irreducible)
    ss_res = float(np.sum((y - fitted) ** 2))
    ss_tot = float(np.sum((y - np.mean(y)) ** 2))
    flat = ss_tot <= len(y) * (1e-12 * float(np.max(y))) ** 2      # y constant to rounding
    r2 = math.nan if flat else 1.0 - ss_res / ss_tot
    ci = (math.nan, math.nan)
    if bootstrap:
        alphas = _bootstrap(u, y, fitted, params, irreducible, bootstrap, seed)
        if len(alphas) >= max(2, bootstrap // 2):
            tail = 100 * (1 - confidence) / 2
            lo, hi = np.percentile(alphas, [tail, 100 - tail])
            ci = (float(lo), float(hi))
    e, a, alpha = params if irreducible else (0.0, *params)
    return PowerLaw(E=float(e), A=float(a * scale ** alpha), exponent=float(alpha),
                    r2=float(r2), ci=ci, n=len(x))


def _bootstrap(u: np.ndarray, y: np.ndarray, fitted: np.ndarray, params: np.ndarray,
               irreducible: bool, times: int, seed: int) -> np.ndarray:
    """The exponents of ``times`` refits on fitted + resampled (centred, inflated)
    residuals, each started from the point estimate only (on 6 test families this matched
    the best of all the starts of the point fit to 1e-8, at a fifth of the time)."""
    rng = np.random.default_rng(seed)
    residuals = y - fitted
    residuals = (residuals - residuals.mean()) * np.sqrt(len(y) / (len(y) - len(params)))
    alphas = []
    for _ in range(times):
        y_star = fitted + rng.choice(residuals, size=len(y), replace=True)
        if np.min(y_star) <= 0:
            continue
        best = _least_squares(u, y_star, irreducible, [params])
        if best is not None:
            alphas.append(best[0][-1])
    return np.asarray(alphas)


def loglog_slope(x, y) -> float:
    """The exponent a of a pure power law y = A x^-a: minus the least-squares slope of
    log y against log x (Kaplan's form, no irreducible term); positive for decreasing y."""
    x, y = _check_xy("loglog_slope", x, y, 2)
    slope, _ = np.polyfit(np.log(x), np.log(y), 1)
    return float(-slope)


# ----------------------------------------------------------------------------- the frontier

def _check_curves(curves) -> list[tuple[np.ndarray, np.ndarray]]:
    """The curves as (flops, loss) float arrays, flops positive and increasing."""
    if len(curves) == 0:
        raise ValueError("compute_frontier needs at least 1 curve, got 0")
    out = []
    for i, (flops, loss) in enumerate(curves):
        flops, loss = np.asarray(flops, dtype=float), np.asarray(loss, dtype=float)
        if flops.ndim != 1 or flops.shape != loss.shape or len(flops) == 0:
            raise ValueError(f"curve {i} needs flops and loss of the same non-zero length, "
                             f"got shapes {flops.shape} and {loss.shape}")
        if not (np.all(np.isfinite(flops)) and np.all(np.isfinite(loss))):
            raise ValueError(f"curve {i} has non-finite flops or loss (NaN/inf)")
        if np.any(flops <= 0):
            raise ValueError(f"curve {i} needs positive flops, got {flops.min()!r}")
        if np.any(np.diff(flops) <= 0):
            raise ValueError(f"curve {i} needs strictly increasing flops")
        out.append((flops, loss))
    return out


def compute_frontier(curves, *, points: int = 24, start: float | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The compute frontier: the lowest loss any member reached with at most C FLOPs, and
    which member reached it.

    ``curves``: one (flops, loss) pair of arrays per member, flops increasing. The grid is
    ``points`` log-spaced C from the smallest first flops (or ``start``, if later) to the
    largest last flops. Member
    i's best loss with at most C FLOPs is the running minimum of its curve, interpolated
    linearly in log C, up to C (give or take a relative 1e-9 of rounding at the ends), and
    its lowest loss beyond its last point (it could stop there). So the frontier never rises
    with C, and a member's late overfitting (or a rise of any kind) is not counted against
    it: early stopping. This reads every eval of a run as a run of that length, which holds
    exactly for a learning-rate schedule that does not depend on the total steps (warm-up
    then inverse square root, as the scaling_laws experiment uses) and roughly otherwise.
    Returns (C, L, owner), owner the index of the member attaining the minimum (the first
    on a tie); grid points before every curve's start are left out.
    """
    curves = _check_curves(curves)
    if points < 2:
        raise ValueError(f"compute_frontier needs points >= 2, got {points}")
    lo = min(float(f[0]) for f, _ in curves)
    hi = max(float(f[-1]) for f, _ in curves)
    if start is not None:
        if not lo <= start < hi:
            raise ValueError(f"compute_frontier: start={start!r} must lie in [{lo}, {hi}), the "
                             "compute the curves cover")
        lo = float(start)
    grid = np.exp(np.linspace(np.log(lo), np.log(hi), points))
    grid[0], grid[-1] = lo, hi          # exactly the end points (exp(log) rounds)
    table = np.full((len(curves), points), np.inf)
    for i, (flops, loss) in enumerate(curves):
        first, last = flops[0] * (1 - _COVER_SLACK), flops[-1] * (1 + _COVER_SLACK)
        covered = (grid >= first) & (grid <= last)
        table[i, covered] = np.interp(np.log(grid[covered]), np.log(flops), loss)
        table[i, grid > last] = np.min(loss)
        table[i] = np.minimum.accumulate(table[i])
    owner = np.argmin(table, axis=0)
    envelope = table[owner, np.arange(points)]
    keep = np.isfinite(envelope)
    return grid[keep], envelope[keep], owner[keep].astype(int)


def optimal_size_exponent(curves, sizes, *, points: int = 24, start: float | None = None
                          ) -> tuple[float, np.ndarray, np.ndarray]:
    """The exponent of N_opt ∝ C^exponent from the compute frontier's owners.

    N_opt(C) = sizes[owner(C)] on the grid of :func:`compute_frontier`; the exponent is the
    least-squares slope of log N_opt against log C over the grid points (Kaplan et al.
    0.73, Chinchilla 0.50). When a single member owns the whole frontier the slope says
    nothing, and the exponent is nan. Curves running far past the compute at which their
    size is optimal bias it low (the ends of the frontier plateau at the smallest and the
    largest size). ``start`` as in :func:`compute_frontier`. Returns (exponent, C, N_opt).
    """
    sizes = np.asarray(sizes, dtype=float)
    if sizes.shape != (len(curves),):
        raise ValueError(f"optimal_size_exponent needs one size per curve, got {sizes.size} "
                         f"sizes for {len(curves)} curves")
    if not np.all(np.isfinite(sizes)) or np.any(sizes <= 0):
        raise ValueError("optimal_size_exponent needs positive, finite sizes")
    grid, _, owner = compute_frontier(curves, points=points, start=start)
    n_opt = sizes[owner]
    if len(np.unique(owner)) < 2:
        return math.nan, grid, n_opt
    slope, _ = np.polyfit(np.log(grid), np.log(n_opt), 1)
    return float(slope), grid, n_opt


# ----------------------------------------------------------------------------- the analysis

# letter: (group, x key, y key, exponent name, x axis label)
_PARTS = {
    "N": ("size", "non_embedding_params", "final_eval_loss", "alpha_N",
          "non-embedding parameters N"),
    "D": ("data", "train_tokens", "best_eval_loss", "beta_D", "training tokens D"),
}
_LAWS = (("L(N)", "alpha_N", "N"), ("L(C)", "gamma_C", "C"), ("L(D)", "beta_D", "D"))
_SYMBOLS = {"alpha_N": "α_N", "gamma_C": "γ_C", "beta_D": "β_D"}
_MEMBER_KEYS = ("member", "group", "params", "non_embedding_params", "tokens", "train_tokens",
                "flops", "final_eval_loss", "best_eval_loss")


def _usable(value) -> bool:
    """A positive, finite number (not a bool, not None)."""
    return (isinstance(value, (int, float, np.integer, np.floating))
            and not isinstance(value, bool) and math.isfinite(value) and value > 0)


def _law_keys(name: str, letter: str, law: PowerLaw | None, n: int,
              pure: float | None) -> dict:
    """The fit.json keys of one law: exponent, its interval, E, A, r2, n and the pure slope."""
    ci = list(law.ci) if law else [None, None]
    return {name: law.exponent if law else None, f"{name}_ci": ci,
            f"E_{letter}": law.E if law else None, f"A_{letter}": law.A if law else None,
            f"r2_{letter}": law.r2 if law else None, f"n_{letter}": n,
            f"{name}_loglog": pure}


def _fit_group(rows: list[dict], letter: str, bootstrap: int, notes: list[str]) -> dict:
    """Fits L(N) (size rows) or L(D) (data rows): keys for fit.json and, under "_plot", the
    points and the law for the figure. Too few usable rows give null keys and a note."""
    group, x_key, y_key, name, _ = _PARTS[letter]
    members = [r for r in rows if r.get("group") == group]
    points = [(r[x_key], r[y_key], r["member"]) for r in members
              if _usable(r.get(x_key)) and _usable(r.get(y_key))]
    dropped = [str(r.get("member")) for r in members
               if not (_usable(r.get(x_key)) and _usable(r.get(y_key)))]
    if dropped:
        notes.append(f"L({letter}): left out {', '.join(dropped)} (no positive, finite "
                     f"{x_key} and {y_key})")
    x = np.array([p[0] for p in points], dtype=float)
    y = np.array([p[1] for p in points], dtype=float)
    law, pure = None, None
    if len(np.unique(x)) >= 4:
        law = fit_power_law(x, y, bootstrap=bootstrap)
        pure = loglog_slope(x, y)
    elif members:
        notes.append(f"L({letter}): {len(np.unique(x))} {group} members with distinct "
                     f"{x_key}, a fit needs 4: no fit")
    out = _law_keys(name, letter, law, len(x), pure)
    out["_plot"] = {"x": x, "y": y, "law": law, "members": len(members)}
    return out


def _curve(row: dict) -> tuple[np.ndarray, np.ndarray]:
    """(flops, eval_loss) of a row's curve: points with positive, finite flops and finite loss,
    each with more flops than every point before it (a repeated eval is dropped)."""
    flops, loss = [], []
    for point in row.get("curve") or []:
        c, value = point.get("flops"), point.get("eval_loss")
        if _usable(c) and _usable(value) and (not flops or c > flops[-1]):
            flops.append(float(c))
            loss.append(float(value))
    return np.array(flops), np.array(loss)


def _fit_compute(rows: list[dict], bootstrap: int, notes: list[str]) -> dict:
    """The compute frontier of every row's curve, L(C) fitted on it and the N_opt exponent,
    from the compute at which the first member finishes on: below it the frontier is the
    smallest member's warm-up alone (the steep start of one learning curve, not a trade-off
    between sizes), which the fit would take for the law (measured on the quick grid:
    gamma 0.52 with E pinned at the lowest loss, r² 0.96, against 0.21 and 0.98 from there)."""
    members = [(r, *_curve(r)) for r in rows]
    members = [m for m in members if len(m[1])]
    if len(members) < 2:
        raise ValueError(f"analyze needs at least 2 rows with eval curves (curve points with "
                         f"flops and eval_loss) for the compute law, got {len(members)}")
    for r, _, _ in members:
        if not _usable(r.get("non_embedding_params")):
            raise ValueError(f"row {r.get('member')!r} needs a positive non_embedding_params "
                             f"for N_opt(C), got {r.get('non_embedding_params')!r}")
    curves = [(f, loss) for _, f, loss in members]
    sizes = [float(r["non_embedding_params"]) for r, _, _ in members]
    start = min(float(f[-1]) for f, _ in curves)
    start = None if start >= max(float(f[-1]) for f, _ in curves) else start
    C, L, owner = compute_frontier(curves, start=start)
    n_opt, _, _ = optimal_size_exponent(curves, sizes, start=start)
    if math.isnan(n_opt):
        notes.append("N_opt(C): one member owns the whole frontier: no exponent")
    law = fit_power_law(C, L, bootstrap=bootstrap)
    out = _law_keys("gamma_C", "C", law, len(C), loglog_slope(C, L))
    out["n_opt_exponent"] = n_opt
    names = [str(r["member"]) for r, _, _ in members]
    out["frontier"] = {"flops": C, "loss": L, "member": [names[i] for i in owner]}
    out["_plot"] = {"curves": curves, "sizes": sizes, "C": C, "L": L, "law": law}
    return out


def _plain(value):
    """``value`` for json: numpy scalars and arrays as Python numbers and lists, nan as None."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return value


def analyze(rows: Sequence[dict], workdir, *, bootstrap: int = 1000, title: str = "") -> dict:
    """Fits the sweep's scaling laws; writes fit.json, scaling.png and scaling.md in workdir.

    L(N) = E + A N^-alpha_N on the "size" rows (non_embedding_params, final_eval_loss);
    L(C) = E + A C^-gamma_C on the compute frontier of every row's eval curve, with the
    N_opt(C) ∝ C^n_opt exponent from the frontier's owners; L(D) = E + A D^-beta_D on the
    "data" rows (train_tokens, best_eval_loss). A part without (enough) rows has null keys
    and a note; the compute part needs at least 2 rows with curves. Returns fit.json's dict.
    """
    rows = list(rows)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise TypeError(f"analyze needs result rows (dicts), row {i} is a "
                             f"{type(row).__name__}")
        if "member" not in row:
            raise ValueError(f"analyze needs a 'member' name in every row, row {i} has none")
    notes: list[str] = []
    size = _fit_group(rows, "N", bootstrap, notes)
    compute = _fit_compute(rows, bootstrap, notes)
    data = _fit_group(rows, "D", bootstrap, notes)
    plots = {"N": size.pop("_plot"), "C": compute.pop("_plot"), "D": data.pop("_plot")}
    result = {**size, **compute, **data, "title": title, "notes": notes,
              "bootstrap": bootstrap, "kaplan": KAPLAN, "chinchilla": CHINCHILLA,
              "members": [{k: row.get(k) for k in _MEMBER_KEYS} for row in rows]}
    result = _plain(result)
    workdir = storage.makedirs(workdir)   # local, or a bucket; each file written whole
    text = json.dumps(result, indent=2, sort_keys=True, allow_nan=False) + "\n"
    storage.write_text(workdir / "fit.json", text)
    storage.write_bytes(workdir / "scaling.png", _plot(result, plots))
    storage.write_text(workdir / "scaling.md", _markdown(result))
    return result


# ----------------------------------------------------------------------------- the report

def _number(value, digits: int = 3) -> str:
    """``value`` to ``digits`` decimals, or an em dash for None/nan."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{value:.{digits}f}"


def _with_interval(value, ci) -> str:
    """'0.352 [0.336, 0.378]', the interval left out when there is none."""
    if value is None:
        return "—"
    if ci is None or any(c is None for c in ci):
        return _number(value)
    return f"{_number(value)} [{_number(ci[0])}, {_number(ci[1])}]"


def _law_title(fit: dict, label: str, name: str, letter: str) -> str:
    """A panel title: the fitted exponent with its 90% interval and r²."""
    value = fit[name]
    if value is None:
        return f"{label}: no fit"
    return (f"{label}: {_SYMBOLS[name]} = {_with_interval(value, fit[f'{name}_ci'])}, "
            f"r² = {_number(fit[f'r2_{letter}'])}")


def _draw_law(ax, x: np.ndarray, y0: float, x0: float, law: PowerLaw | None,
              kaplan: float, letter: str) -> None:
    """The fitted curve over x and a dashed line of Kaplan's slope through (x0, y0)."""
    grid = np.geomspace(x.min(), x.max(), 100)
    if law is not None:
        ax.plot(grid, law(grid), color="tab:red", lw=1.5,
                label=f"fit: {law.E:.3f} + {law.A:.3g}·{letter}^-{law.exponent:.3f}")
    ax.plot(grid, y0 * (grid / x0) ** -kaplan, "--", color="0.4", lw=1,
            label=f"Kaplan et al. slope -{kaplan:.3f}")


def _log_axes(ax) -> None:
    """Log-log axes, the loss ticks written as plain numbers (2, 3, 4 rather than 4e0)."""
    from matplotlib.ticker import FormatStrFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))


def _points_panel(ax, fit: dict, points: dict, letter: str) -> None:
    """Panel (a) or (c): the members' points, the fit and Kaplan's slope, or 'no members'."""
    name, label = _PARTS[letter][3], _PARTS[letter][4]
    x, y = points["x"], points["y"]
    ax.set_xlabel(label)
    ax.set_ylabel("eval loss L (nats/token)")
    ax.set_title(_law_title(fit, f"L({letter})", name, letter), fontsize=10)
    if len(x) == 0:
        ax.text(0.5, 0.5, "no members", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    _log_axes(ax)
    ax.plot(x, y, "o", color="tab:blue", label=f"members ({len(x)})")
    if len(np.unique(x)) > 1:
        first = int(np.argmin(x))
        _draw_law(ax, x, y[first], x[first], points["law"], KAPLAN[name], letter)
    if points["law"] is None:
        ax.text(0.5, 0.9, f"too few members for a fit ({len(x)})", ha="center",
                transform=ax.transAxes)
    ax.legend(fontsize=8)


def _compute_panel(fig, ax, fit: dict, points: dict) -> None:
    """Panel (b): every member's eval curve coloured by N, the frontier, its fit, Kaplan."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import LogNorm

    sizes = np.asarray(points["sizes"])
    low, high = sizes.min(), sizes.max()
    norm = LogNorm(low, high if high > low else low * 10)
    cmap = colormaps["viridis"]
    for (flops, loss), n in zip(points["curves"], sizes):
        ax.plot(flops, loss, color=cmap(norm(n)), lw=0.8, alpha=0.8)
    C, L = points["C"], points["L"]
    ax.plot(C, L, color="black", lw=2.5, label="frontier (lower envelope)")
    _draw_law(ax, C, L[0], C[0], points["law"], KAPLAN["gamma_C"], "C")
    _log_axes(ax)
    ax.set_xlabel("training FLOPs C")
    ax.set_ylabel("eval loss L (nats/token)")
    ax.set_title(_law_title(fit, "L(C)", "gamma_C", "C"), fontsize=10)
    ax.legend(fontsize=8)
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax,
                 label="non-embedding parameters N")


def _plot(fit: dict, plots: dict) -> bytes:
    """scaling.png: L(N), L(C) and L(D) side by side on log-log axes, as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.5), dpi=120)
    FigureCanvasAgg(fig)
    ax_n, ax_c, ax_d = fig.subplots(1, 3)
    _points_panel(ax_n, fit, plots["N"], "N")
    _compute_panel(fig, ax_c, fit, plots["C"])
    _points_panel(ax_d, fit, plots["D"], "D")
    for ax, tag in zip((ax_n, ax_c, ax_d), "abc"):
        ax.text(-0.02, 1.02, f"({tag})", transform=ax.transAxes, ha="right", va="bottom",
                fontweight="bold")
    if fit.get("title"):
        fig.suptitle(fit["title"])
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _markdown(fit: dict) -> str:
    """scaling.md: one table row per law, our exponents beside Kaplan's and Chinchilla's."""
    head = f"# Scaling laws: {fit['title']}" if fit.get("title") else "# Scaling laws"
    header = ("| law | exponent (90% interval) | E | r² | pure power law (no E) "
              "| Kaplan et al. 2020 | Chinchilla (Hoffmann et al. 2022) |")
    lines = [head, "", header, "|---|---|---|---|---|---|---|"]
    for label, name, letter in _LAWS:
        law = f"{label} = E + A·{letter}^-{_SYMBOLS[name]}"
        lines.append(
            f"| {law} | {_with_interval(fit[name], fit[f'{name}_ci'])} "
            f"| {_number(fit[f'E_{letter}'])} | {_number(fit[f'r2_{letter}'])} "
            f"| {_number(fit[f'{name}_loglog'])} | {_number(KAPLAN[name])} "
            f"| {_number(CHINCHILLA.get(name))} |")
    lines.append(f"| N_opt(C) ∝ C^n | {_number(fit['n_opt_exponent'])} | — | — | — "
                 f"| {_number(KAPLAN['n_opt'])} | {_number(CHINCHILLA['n_opt'])} |")
    groups: dict[str, int] = {}
    for member in fit["members"]:
        groups[str(member["group"])] = groups.get(str(member["group"]), 0) + 1
    counts = ", ".join(f"{n} {g}" for g, n in sorted(groups.items()))
    lines += ["", (f"Members: {len(fit['members'])} ({counts}). Intervals: residual "
                   f"bootstrap, {fit['bootstrap']} resamples, 5th to 95th percentile.")]
    if fit["notes"]:
        lines += ["", *(f"- note: {note}" for note in fit["notes"])]
    return "\n".join(lines) + "\n"
