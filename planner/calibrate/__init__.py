"""Calibration: microbenchmarks, fits and refits that make the cost model match a machine.

- :mod:`~planner.calibrate.microbench` GEMM, memory-bound and attention sweeps (torch
  only; collectives are in :mod:`strategies.microbench`);
- :mod:`~planner.calibrate.fit` the ``scipy.optimize.least_squares`` fits;
- :mod:`~planner.calibrate.profile` samples to a :class:`~planner.hardware.HardwareProfile`;
- :mod:`~planner.calibrate.refit` refit a profile to measured runs;
- :mod:`~planner.calibrate.links` fit a link tier's NCCL protocol curve to collective
  times, :mod:`~planner.calibrate.nccl_tests` read them from nccl-tests output;
- :mod:`~planner.calibrate.options` the cost options of the measured runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from planner.lazy import lazy_attributes

_LAZY = {
    "CalibrationError": "planner.calibrate.fit",
    "FitResult": "planner.calibrate.fit",
    "fit_alpha_beta": "planner.calibrate.fit",
    "fit_matmul": "planner.calibrate.fit",
    "measured_run_options": "planner.calibrate.options",
    "RefitReport": "planner.calibrate.refit",
    "predict_plan": "planner.calibrate.refit",
    "refit_profile": "planner.calibrate.refit",
}
if TYPE_CHECKING:
    from planner.calibrate.fit import CalibrationError, FitResult, fit_alpha_beta, fit_matmul
    from planner.calibrate.options import measured_run_options
    from planner.calibrate.refit import RefitReport, predict_plan, refit_profile

__all__ = [
    "CalibrationError",
    "FitResult",
    "RefitReport",
    "fit_alpha_beta",
    "fit_matmul",
    "measured_run_options",
    "predict_plan",
    "refit_profile",
]

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
