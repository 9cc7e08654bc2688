"""How each pool's replica count follows its queue depth, on Ray Serve's autoscaler.

Signals, one per pool, each averaged by Serve over `look_back_s`:
- router: the HTTP requests a replica holds (running, waiting at its gate, being refused),
  which is what Serve counts itself: its built-in policy with `target_ongoing_requests`.
- draft and target pools: the sequences a replica is serving. Serve's own count, calls in
  flight, undercounts them: a router gathers the calls of all its sequences of a lane into one
  handle call per round (router/gathering.py). So each replica reports the sequences it is
  serving, from its batcher (`record_autoscaling_stats`): the calls queued and running plus
  the sequences expected to call again (not yet released). SequencesPerReplica sums them
  over the running replicas and asks for ceil(sum / target_queue_per_replica). The draft
  pool's count follows the verify rounds by construction: every round of a sequence that
  speculates makes one propose call; a sequence that also drafts ahead (overlap,
  router/lookahead.py) sends a second stream of calls, its lookaheads, and counts twice, so
  the capacity overlap needs is asked for. A target replica of tp_size shards is one replica here:
  Serve adds and removes whole placement groups.

Serve applies min/max, the up and down delays and the scaling factors to what a policy asks
for. A replica scaled away takes no request with it: a sequence's next call goes to another
replica on the hash ring, which rebuilds its cache from the call's token ids.
"""

from __future__ import annotations

import math

from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

from cluster.config import AutoscalingSettings

ACTIVE_SEQUENCES = "active_sequences"   # the metric replicas report (replicas/deployments.py)


class SequencesPerReplica:
    """A Serve autoscaling policy: replicas for the sequences the running replicas report."""

    def __init__(self, target_queue_per_replica: float):
        self.target = target_queue_per_replica

    def __call__(self, ctx) -> tuple[int, dict]:
        reported = (ctx.aggregated_metrics or {}).get(ACTIVE_SEQUENCES, {})
        if not reported:         # nothing reported yet (replicas starting): keep what there is
            return ctx.target_num_replicas, {}
        return math.ceil(sum(reported.values()) / self.target), {}


def router_autoscaling(settings: AutoscalingSettings) -> AutoscalingConfig:
    return AutoscalingConfig(**_common(settings), target_ongoing_requests=settings.target_queue_per_replica)


def pool_autoscaling(settings: AutoscalingSettings) -> AutoscalingConfig:
    policy = AutoscalingPolicy(policy_function=SequencesPerReplica,
                               policy_kwargs={"target_queue_per_replica": settings.target_queue_per_replica})
    return AutoscalingConfig(**_common(settings), policy=policy)


def _common(settings: AutoscalingSettings) -> dict:
    return {"min_replicas": settings.min_replicas, "max_replicas": settings.max_replicas,
            "initial_replicas": settings.initial_replicas, "upscale_delay_s": settings.upscale_delay_s,
            "downscale_delay_s": settings.downscale_delay_s, "look_back_period_s": settings.look_back_s}
