"""Run Vidur-Search (vidur.config_optimizer.config_explorer.main of the vidur==0.0.26 wheel) with
the runtime patches of vidur_search_patch.py, on Ray (default) or serially (--serial).

All of Vidur-Search's own options pass through unchanged (--config-path, --output-dir,
--cache-dir, --scheduling-delay-slo-value, --scheduling-delay-slo-quantile,
--min-search-granularity, --max-iterations, --time-limit [minutes of SIMULATED time, 0 = none],
--skip-cache-warmup, --debug). The SLO value/quantile options apply to the metric chosen here.

Extra options (this wrapper's):
  --metric ttft|scheduling_delay     (default ttft; upstream: scheduling_delay)
  --arrivals poisson|trace           (default poisson = upstream; trace = time-scaled replay)
  --replay-trace CSV                 wheel-format trace for --arrivals trace
  --start-qps-per-replica            start_qps x replicas per job (schedlab's convention)
  --slots N                          simulations in flight under Ray (default: CPU count)
  --serial                           no Ray: the jobs one after another in this process

Writes, besides upstream's OUTPUT/{args.json,config.json,runs/<job hash>/<qps>/...}:
OUTPUT/jobs.json (job hash -> job) and OUTPUT/results.json (max_qps_under_sla per job; upstream
only logs it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

P = "--random_forrest_execution_time_predictor_config"
DEFAULT_EXTRA = " ".join(
    [
        "--seed 42",
        "--replica_config_network_device a100_pairwise_nvlink",
        "--global_scheduler_config_type round_robin",
        f"{P}_model_profiling_dataset local/vidur-repo-a100-llama-2-7b-hf",
        f"{P}_network_profiling_dataset local/vidur-repo-a100-pairwise-nvlink",
        f"{P}_prediction_max_tokens_per_request 4096",
        f"{P}_prediction_max_prefill_chunk_size 4096",
        f"{P}_prediction_max_batch_size 128",
        "--no-metrics_config_write_json_trace",
    ]
)


def main() -> None:
    ours = argparse.ArgumentParser(add_help=False)
    ours.add_argument("--metric", choices=("ttft", "scheduling_delay"), default="ttft")
    ours.add_argument("--arrivals", choices=("poisson", "trace"), default="poisson")
    ours.add_argument("--replay-trace", default="/tmp/vidurrun/traces/splitwise_conv_first19366.csv")
    ours.add_argument("--replay-date", default="2023-11-16")
    ours.add_argument("--start-qps-per-replica", action="store_true")
    ours.add_argument("--slots", type=int, default=None)
    ours.add_argument("--serial", action="store_true")
    ours.add_argument("--extra", default=DEFAULT_EXTRA, help="extra vidur.main flags for every simulation")
    mine, rest = ours.parse_known_args()

    os.environ.update(
        {
            "VIDUR_SEARCH_METRIC": mine.metric,
            "VIDUR_SEARCH_ARRIVALS": mine.arrivals,
            "VIDUR_SEARCH_REPLAY_TRACE": os.path.abspath(mine.replay_trace),
            "VIDUR_SEARCH_DATE": mine.replay_date,
            "VIDUR_SEARCH_PYTHON": sys.executable,
            "VIDUR_SEARCH_EXTRA": mine.extra,
            "VIDUR_SEARCH_START_PER_REPLICA": "1" if mine.start_qps_per_replica else "0",
            "VIDUR_SEARCH_SLOTS": str(mine.slots or os.cpu_count()),
            "HF_HUB_OFFLINE": "1",
            "WANDB_MODE": "disabled",
            "WANDB_SILENT": "true",
            # Ray workers must import vidur_search_patch (they inherit this environment)
            "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", ""),
        }
    )
    sys.path.insert(0, HERE)

    import yaml

    import vidur_search_patch

    vidur_search_patch.apply_patches()

    from vidur.config_optimizer.config_explorer import config_explorer as ce
    from vidur.config_optimizer.config_explorer.config import JobConfig
    from vidur.config_optimizer.config_explorer.main import get_args

    sys.argv = [sys.argv[0]] + rest
    args = get_args()
    args.num_threads = max(1, args.num_threads)  # (cpu_count - 2 = 0 here; unused by the search)
    args.output_dir = os.path.abspath(args.output_dir)
    args.cache_dir = os.path.abspath(args.cache_dir)
    config = yaml.safe_load(open(args.config_path))
    assert 0 <= args.scheduling_delay_slo_quantile <= 1

    os.makedirs(args.output_dir, exist_ok=True)
    json.dump(vars(args), open(f"{args.output_dir}/args.json", "w"))
    json.dump(config, open(f"{args.output_dir}/config.json", "w"))
    json.dump(vars(mine), open(f"{args.output_dir}/wrapper_args.json", "w"))
    jobs = JobConfig.generate_job_configs(config)
    json.dump(
        {
            j.get_hash(): {
                "name": j.get_human_readable_name(),
                "start_qps": j.start_qps,
                "num_replicas": j.num_replicas,
                **j.to_config_dict(),
            }
            for j in jobs
        },
        open(f"{args.output_dir}/jobs.json", "w"),
        indent=1,
    )
    print(
        f"vidur_search: {len(jobs)} job(s); metric {mine.metric} P{args.scheduling_delay_slo_quantile} "
        f"<= {args.scheduling_delay_slo_value} s; arrivals {mine.arrivals}",
        flush=True,
    )

    t0 = time.time()
    if mine.serial:
        from vidur.config_optimizer.config_explorer.capacity_search import CapacitySearch

        results = [CapacitySearch(j, args).search() for j in jobs]
    else:
        import ray

        ray.init(
            num_cpus=os.cpu_count(),
            include_dashboard=False,
            runtime_env={"worker_process_setup_hook": "vidur_search_patch.apply_patches"},
        )
        ce.RayParallelRunner = vidur_search_patch._make_slot_runner()
        results = ce.ConfigExplorer(args, config).run()  # its own ray.init is then a no-op
    wall = time.time() - t0

    json.dump({"wall_s": wall, "results": results}, open(f"{args.output_dir}/results.json", "w"), indent=1)
    for r in results:
        print(
            f"{r['replica_config_model_name']} {r['replica_config_device']} replicas={r['cluster_config_num_replicas']} "
            f"{r['replica_scheduler_config_type']} cs={r.get('sarathi_scheduler_config_chunk_size')} "
            f"bsz={r['sarathi_scheduler_config_batch_size_cap']}: max_qps_under_sla={r['max_qps_under_sla']}",
            flush=True,
        )
    print(f"vidur_search: done in {wall:.1f} s -> {args.output_dir}/results.json", flush=True)


if __name__ == "__main__":
    main()
