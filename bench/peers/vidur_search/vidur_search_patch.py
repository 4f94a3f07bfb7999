"""Runtime patches that make Vidur-Search (vidur.config_optimizer.config_explorer, as shipped in
the vidur==0.0.26 wheel) run here. Nothing in the installed wheel is edited.

apply_patches() runs in the driver and, through Ray's worker_process_setup_hook, in every Ray
worker (run_search / CapacitySearch execute in workers, where the driver's monkeypatches would
not exist). Settings travel as environment variables (a local Ray's workers inherit the driver's
environment):

  VIDUR_SEARCH_METRIC    ttft (default) | scheduling_delay   the SLO metric the search tests
  VIDUR_SEARCH_ARRIVALS  poisson (default, Vidur-Search's own) | trace
                         poisson: the search's synthetic generator, Poisson arrivals at QPS
                                  (intervals capped at 3/QPS), lengths = the YAML trace shuffled;
                         trace:   trace_replay of VIDUR_SEARCH_REPLAY_TRACE with its arrivals
                                  time-scaled to mean rate QPS (= schedlab's traces.to_rate)
  VIDUR_SEARCH_REPLAY_TRACE  wheel-format trace (Date,Time,PromptTokenCount,CompletionTokenCount)
  VIDUR_SEARCH_DATE      the Date value of that trace (default 2023-11-16)
  VIDUR_SEARCH_PYTHON    interpreter for the simulations (default: sys.executable)
  VIDUR_SEARCH_ENTRY     simulation entry (default: vidur_main_patched.py beside this file,
                         vidur.main + the Request.restart fix)
  VIDUR_SEARCH_EXTRA     extra vidur.main flags appended to every simulation
  VIDUR_SEARCH_SLOTS     simulations in flight at once under Ray (default: os.cpu_count())
  VIDUR_SEARCH_START_PER_REPLICA  1: a job's start_qps = trace start_qps x its replicas

What is patched, and why:
 1. CapacitySearch._generate_run_command: runs the patched entry with this venv's python
    (the original runs `python -m vidur.main` from PATH, unpatched, crashing on the first
    recompute preemption), with HF_HUB_OFFLINE / wandb off, plus VIDUR_SEARCH_EXTRA (network
    device, local profiling datasets, predictor grid caps: without them the wheel defaults to
    h100_dgx, project-vajra HF datasets and prediction_max_tokens_per_request=2M, i.e. a new
    multi-hour training with a different cache key).
 2. JobConfig.to_config_dict: drops lightllm_/faster_transformer_scheduler_config_batch_size_cap
    (the repo-era search emits them; the 0.0.26 vidur.main rejects them: argparse error, the
    run "fails", and the search stops with max_qps_under_sla None).
 3. ClusterConfig.get_key: adds num_gpus. Upstream keys a cluster by device only, so 1-, 2- and
    4-GPU jobs get the same job hash and share runs/<hash>/<qps>/ (cached results are reused
    across replica counts).
 4. CapacitySearch._get_result_file/_is_under_sla: the SLO metric (TTFT = prefill_e2e_time, or
    upstream's request_scheduling_delay); the log line names the metric and also reports the other.
 5. SimulationConfig.to_config_dict: trace-replay arrivals (VIDUR_SEARCH_ARRIVALS=trace).
 6. JobConfig.__init__: optional start_qps x replicas.
 7. ray_utils' CpuAssignmentManager reserves os.cpu_count() - 2 cores = 0 on a 2-core machine,
    so RayParallelRunner.map waits forever: the driver uses SlotRunner below instead
    (VIDUR_SEARCH_SLOTS slots, each pinned to one core with taskset, as upstream).
"""

from __future__ import annotations

import glob
import os
import shlex
import sys
import time
from functools import lru_cache

METRIC_FILES = {"ttft": "prefill_e2e_time", "scheduling_delay": "request_scheduling_delay"}
DEFAULT_ENTRY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vidur_main_patched.py")
DROP_KEYS = (
    "lightllm_scheduler_config_batch_size_cap",
    "faster_transformer_scheduler_config_batch_size_cap",
)
_APPLIED = False


def _metric() -> str:
    m = os.environ.get("VIDUR_SEARCH_METRIC", "ttft")
    if m not in METRIC_FILES:
        raise ValueError(f"VIDUR_SEARCH_METRIC={m!r}: one of {sorted(METRIC_FILES)}")
    return m


@lru_cache(maxsize=None)
def replay_mean_rate(path: str, date: str) -> float:
    """(n - 1) / (last - first arrival) of the rows with Date == date: schedlab's mean_rate."""
    import pandas as pd

    df = pd.read_csv(path)
    t = df.loc[df["Date"] == date, "Time"].sort_values()
    return float((len(t) - 1) / (t.iloc[-1] - t.iloc[0]))


def apply_patches() -> None:
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True

    import pandas as pd

    from vidur.config_optimizer.config_explorer import capacity_search as cs
    from vidur.config_optimizer.config_explorer import config as cfg
    from vidur.logger import init_logger

    logger = init_logger("vidur.config_optimizer.search_patch")

    # 1. the simulation command
    def _generate_run_command(self, simulation_config):
        py = os.environ.get("VIDUR_SEARCH_PYTHON") or sys.executable
        entry = os.environ.get("VIDUR_SEARCH_ENTRY", DEFAULT_ENTRY)
        aff = ""
        if self.cpu_core_id is not None:
            aff = f"taskset --cpu-list {self.cpu_core_id}"
        env = "env HF_HUB_OFFLINE=1 WANDB_MODE=disabled WANDB_SILENT=true PYTHONUNBUFFERED=1"
        extra = os.environ.get("VIDUR_SEARCH_EXTRA", "")
        return f"{env} nice -n 1 {aff} {shlex.quote(py)} {shlex.quote(entry)} {simulation_config.to_args()} {extra}"

    cs.CapacitySearch._generate_run_command = _generate_run_command

    # 2. options the 0.0.26 vidur.main does not have
    _orig_job_dict = cfg.JobConfig.to_config_dict

    def _job_dict(self):
        d = _orig_job_dict(self)
        for k in DROP_KEYS:
            d.pop(k, None)
        return d

    cfg.JobConfig.to_config_dict = _job_dict

    # 3. replica count in the job key/hash
    cfg.ClusterConfig.get_key = lambda self: f"{self.device}_g{self.num_gpus}"

    # 4. the SLO metric
    def _get_result_file(self, run_dir):
        files = glob.glob(f"{run_dir}/*/plots/{METRIC_FILES[_metric()]}.csv")
        return files[0] if files else None

    def _is_under_sla(self, result_file, simulator_config):
        m = _metric()
        col = METRIC_FILES[m]
        q = self.args.scheduling_delay_slo_quantile
        value = pd.read_csv(result_file)[col].quantile(q)
        other = METRIC_FILES["scheduling_delay" if m == "ttft" else "ttft"]
        other_files = glob.glob(os.path.join(os.path.dirname(result_file), f"{other}.csv"))
        other_v = pd.read_csv(other_files[0])[other].quantile(q) if other_files else None
        logger.info(
            f"{simulator_config.to_human_readable_name()} - {col} (P{q}): {value}"
            f" [SLO {self.args.scheduling_delay_slo_value}] ({other} P{q}: {other_v})"
        )
        return value <= self.args.scheduling_delay_slo_value, value

    cs.CapacitySearch._get_result_file = _get_result_file
    cs.CapacitySearch._is_under_sla = _is_under_sla

    # 5. trace-replay arrivals
    _orig_sim_dict = cfg.SimulationConfig.to_config_dict

    def _sim_dict(self):
        d = _orig_sim_dict(self)
        if os.environ.get("VIDUR_SEARCH_ARRIVALS", "poisson") == "trace":
            path = os.environ["VIDUR_SEARCH_REPLAY_TRACE"]
            date = os.environ.get("VIDUR_SEARCH_DATE", "2023-11-16")
            d.update(
                {
                    "request_generator_config_type": "trace_replay",
                    "trace_request_generator_config_trace_file": path,
                    "trace_request_generator_config_date": date,
                    "trace_request_generator_config_prefill_scale_factor": 1,
                    "trace_request_generator_config_decode_scale_factor": 1,
                    "trace_request_generator_config_time_scale_factor": repr(
                        float(replay_mean_rate(path, date) / self.qps)
                    ),
                }
            )
        return d

    cfg.SimulationConfig.to_config_dict = _sim_dict

    # 6. start_qps per replica
    if os.environ.get("VIDUR_SEARCH_START_PER_REPLICA") == "1":
        _orig_init = cfg.JobConfig.__init__

        def _init(self, *a, **kw):
            _orig_init(self, *a, **kw)
            self.start_qps = self.trace_config.start_qps * self.num_replicas

        cfg.JobConfig.__init__ = _init


# 7. a core-slot manager that works on a 2-core machine
def _make_slot_runner():
    import ray

    @ray.remote(num_cpus=0)
    class SlotManager:
        def __init__(self, slots: int):
            self._busy = [False] * slots

        def get_cpu_core_id(self):
            for i, b in enumerate(self._busy):
                if not b:
                    self._busy[i] = True
                    return i
            return None

        def release_cpu_core_id(self, node, cpu_core_id):  # node: ignored (one machine)
            self._busy[cpu_core_id] = False

    class SlotRunner:
        """config_explorer.RayParallelRunner with N slots instead of os.cpu_count() - 2."""

        def __init__(self):
            slots = int(os.environ.get("VIDUR_SEARCH_SLOTS") or os.cpu_count())
            self._cpu_assignment_manager = SlotManager.remote(slots)

        def map(self, func, collection):
            remote_func = ray.remote(func)
            promises = []
            for item in collection:
                core = None
                while core is None:
                    core = ray.get(self._cpu_assignment_manager.get_cpu_core_id.remote())
                    if core is None:
                        time.sleep(0.5)
                promises.append(remote_func.remote(self._cpu_assignment_manager, core, item))
            return ray.get(promises)

    return SlotRunner
