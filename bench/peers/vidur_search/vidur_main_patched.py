"""Launch `vidur.main` (vidur==0.0.26 wheel) with one bug fix applied at runtime.

Bug: Request.restart() (recompute-preemption when the KV cache is full) resets
_num_processed_tokens but not the per-stage counters _num_stage_processed_tokens /
_is_prefill_stage_complete that 0.0.26 added for sequence-pipeline-parallelism.
The first batch after a restart then trips
    assert self._num_stage_processed_tokens <= self.total_tokens   (entities/request.py:300)
so any run that preempts (e.g. >= ~5000 requests of splitwise_conv on one A100) crashes.
The fix resets both counters; runs without preemption are unchanged (verified:
identical request_metrics for the 1000-request trace with and without the patch).
The installed wheel is not modified.
"""

from vidur.entities.request import Request

_orig_restart = Request.restart


def _restart(self):
    _orig_restart(self)
    self._num_stage_processed_tokens = 0
    self._is_prefill_stage_complete = False


Request.restart = _restart

from vidur.main import main  # noqa: E402

if __name__ == "__main__":
    main()
