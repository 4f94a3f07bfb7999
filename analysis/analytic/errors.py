"""The one error type of the analytic cost model."""

from __future__ import annotations

from schedlab.sim.cost import ProfileError


class AnalyticError(ProfileError):
    """Bad hardware/model/quantisation input: one line for the user, never a traceback.

    A ``ProfileError`` (itself a ``ValueError``), so the CLI's existing handling of bad
    cost-model input prints it as one line with a non-zero exit.
    """
