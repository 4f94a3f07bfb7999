"""``validate``: run-real and simulate on the same trace, policy, options and profile.

Prints, per policy, simulated vs measured metrics with their error and the cost model's
per-step error; writes validation.json beside both runs' directories::

    OUT/validation.json  OUT/sim/  OUT/real/ [OUT/real-2/ ...]      (one policy)
    OUT/validation.json  OUT/<policy>/{validation.json,sim,real}     (--policy all)
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ._app import MODEL_HELP, NOISE_HELP, fail, log_to_stderr, make_app, out_path, parse_options, run_app

validate_app = make_app(
    "Run a policy for real (MLX) and in simulation on the same trace and profile, and print "
    "how far the simulation is from the measurement (metrics and per-step cost-model error)."
)


@validate_app.command()
def validate(
    policy: Optional[str] = typer.Option(
        None, "--policy", "-p", help="a policy name, several (a,b), or 'all' (every bundled one)"
    ),
    trace: Optional[str] = typer.Option(
        None,
        "--trace",
        "-t",
        help="trace file, or a bundled trace's bare name (e.g. real-smoke); with --served: the trace to "
        "simulate (default: the served one)",
    ),
    served: Optional[List[Path]] = typer.Option(
        None,
        "--served",
        help="a real cluster's run directory (serve --replicas N --out DIR, run-real --replicas N --out DIR; "
        "repeatable: several runs of one setting): simulate its traffic on as many replicas behind the same "
        "router, policy and profile, and compare the cluster, each replica and the routing",
    ),
    model: str = typer.Option("tiny", "--model", "-m", help=MODEL_HELP),
    dtype: str = typer.Option("float32", "--dtype", help="float32, float16 or bfloat16"),
    option: Optional[List[str]] = typer.Option(None, "--option", "-o", help="policy option key=value (repeatable)"),
    profile: Optional[str] = typer.Option(
        None,
        "--profile",
        help="cost profile (default: the bundled one if it matches this model and machine, else calibrate --quick first)",
    ),
    hardware: Optional[str] = typer.Option(
        None,
        "--hardware",
        help="use the analytic roofline model of this hardware preset instead of a profile, for the simulation and the real runs' predictions (cpu-local: this machine, with factors fitted by calibrate --analytic where a matching profile has them)",
    ),
    kv_tokens: Optional[int] = typer.Option(None, "--kv-tokens", help="KV capacity in tokens (default: the profile's)"),
    seed: int = typer.Option(0, "--seed", help="seed for the trace and the prompt ids"),
    repeat: int = typer.Option(1, "--repeat", help="real runs per policy (reports their spread)"),
    out: Optional[Path] = typer.Option(
        None, "--out", parser=out_path, help="output directory (default: validate-<trace>)"
    ),
    noise: Optional[str] = typer.Option(None, "--noise", help=NOISE_HELP),
    residuals: bool = typer.Option(
        False,
        "--residuals",
        help="print the per-step residual table (measured/predicted "
        "by rows, tokens, context, joins/leaves, idle gap, batch change) and each step kind "
        "split into its passes and the loop's own time, each against its prediction",
    ),
    speed_probe: str = typer.Option(
        "passes",
        "--speed-probe",
        help="how the machine's speed is timed around the real runs (the drift-adjusted comparison): passes "
        "(the profile's reference passes, seconds) or replay (a default calibration's own replay in the real loop)",
    ),
    probe_every_run: bool = typer.Option(
        False,
        "--probe-every-run",
        help="time the machine's speed after every real run too: each run simulated at its own speed",
    ),
    speculative: Optional[str] = typer.Option(
        None,
        "--speculative",
        help="speculative decoding in both: ngram:k=4 (the real runs' rows verify n-gram drafts; the simulation "
        "draws the accepted ones from the acceptance the real runs measured, or from accept=P1/P2/... or "
        "accept=FILE); the tables compare the acceptance too",
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="only the tables"),
) -> None:
    """Validate the simulator against the real engine for POLICY on TRACE."""
    import schedlab
    from schedlab.api.validation import format_overview

    if served:
        return _validate_served(served, trace, profile, out, policy, option, speculative)
    if policy is None or trace is None:
        fail("Missing option '--policy' / '-p' and '--trace' / '-t' (or give --served DIR)", 2)
    opts = parse_options(option)
    if out is None:  # (validate counts a trace of text with the model's tokenizer: its name, or its file's)
        try:
            name = schedlab.load_trace(trace, seed=seed).name
        except schedlab.SchedlabError:
            name = Path(trace).stem or trace
        out = Path(f"validate-{name}")

    def done(name: str, v: dict) -> None:  # each policy's table as soon as it is done
        from schedlab.analysis.residuals import format_residuals, format_step_split
        from schedlab.analysis.validation import format_table

        print(format_table(v))
        if residuals and v.get("residuals"):
            print(format_residuals(v["residuals"], "per-step residuals over the real runs (measured / predicted):"))
        if residuals and v.get("step_split"):
            title = "where the real steps' time went (medians per step kind; loop: the step outside its passes):"
            print(format_step_split(v["step_split"], title))
        print()

    val = schedlab.validate(
        policy,
        trace,
        model=model,
        dtype=dtype,
        options=opts,
        profile=profile,
        hardware=hardware,
        kv_tokens=kv_tokens,
        seed=seed,
        repeat=repeat,
        out=out,
        noise=noise,
        log=log_to_stderr("validate", quiet),
        on_result=done,
        speed_probe=speed_probe,
        probe_every_run=probe_every_run,
        speculative=speculative,
    )
    if len(val.results) > 1:
        print(format_overview(val.results))
    print(f"wrote {out}")


def _validate_served(served, trace, profile, out, policy, option, speculative) -> None:
    """``validate --served``: a real cluster's runs against their simulation."""
    import schedlab
    from schedlab.api.cluster_validation import format_served

    if policy is not None or option:
        fail("--served runs name their policy and options: drop --policy/-o", 2)
    if speculative is not None:
        fail("--speculative goes with --policy and --trace, not --served (yet)", 2)
    v = schedlab.validate_served(served, trace=trace, profile=profile, out=out)
    print(format_served(v))
    if out is not None:
        print(f"wrote {out}")


def main() -> None:
    run_app(validate_app, "validate")
