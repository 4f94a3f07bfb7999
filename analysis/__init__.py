"""Analysis above the simulator core: what you do *with* simulations and real runs.

- ``analysis.analytic``: roofline cost models for machines you don't have (hardware presets in
  ``analysis/hardware``, model configs in ``analysis/model_configs``) and their fitted efficiencies;
- ``analysis.fit``: fitting a ``sim.cost.LinearCostModel`` to timed passes (used by ``calibrate``);
- ``analysis.validation``: simulated vs measured metrics;
- ``analysis.plots`` / ``analysis.sweep``: figures and rate sweeps.

Depends on ``sim``, ``policies`` and ``traces``; never on ``engine`` (no MLX here).
"""
