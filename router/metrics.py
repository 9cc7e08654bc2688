"""The router's Prometheus series, through Ray's metrics API (exported by every node's
metrics agent, with Serve's deployment, replica and application tags added; Prometheus
names carry Ray's `ray_` prefix). The counting itself happens in plain objects
(SpeculationStats per request, the gate, the goodput controller); this module only exports.
No series is labelled by request.

Series (all `specserve_`): requests_total{status}, errors_total{type}, rounds_total{kind:
speculative | lookup | forced | target_only | fallback}, drafted_tokens_total, accepted_tokens_total,
forced_tokens_total (grammar-forced drafts kept, router/forced_drafts.py),
generated_tokens_total, cache_rebuilds_total{pool}, tokens_per_round, k (the k each round
asked for), verify_batch_size and draft_batch_size (sequences in the forward pass that
served a round), ttft_seconds, inter_token_seconds, router_requests{state: running |
queued}, and the goodput controller's view (router/k_control.py): adaptive_k_share{method, k}
(the share of the method's recent rounds that chose k), adaptive_goodput_tokens_per_s (the
current plan's predicted tokens per second of the batch), adaptive_steps (its steps per verify
call), adaptive_round_ms{kind: predicted | measured}, adaptive_model_error{model:
target_pass | draft_pass | round} (mean |log(measured / predicted)|) and
adaptive_kept_share{source} (of the first drafts the controller's chosen rounds were expected
to keep, the share kept: its gain calibration).
"""

from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

from router.totals import Totals

_SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17]
_K = [0.5, 1, 2, 3, 4, 5, 6, 8, 12, 16]   # boundaries must be positive: k = 0 falls in the first
_SECONDS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30]


class RouterMetrics:
    def __init__(self):
        self.requests = Counter("specserve_requests_total", "HTTP generation requests by status",
                                tag_keys=("status",))
        self.errors = Counter("specserve_errors_total", "Failed requests by error type", tag_keys=("type",))
        self.rounds = Counter("specserve_rounds_total", "Speculation rounds by kind", tag_keys=("kind",))
        self.drafted = Counter("specserve_drafted_tokens_total", "Draft tokens sent to verification")
        self.accepted = Counter("specserve_accepted_tokens_total", "Draft tokens the target kept")
        self.forced = Counter("specserve_forced_tokens_total", "Tokens a grammar forced, drafted by the router "
                              "and kept (router/forced_drafts.py)")
        self.generated = Counter("specserve_generated_tokens_total", "Tokens generated for clients")
        self.rebuilds = Counter("specserve_cache_rebuilds_total",
                                "Calls after a sequence's first that recomputed the whole sequence "
                                "(its cache was evicted or its replica replaced)", tag_keys=("pool",))
        self.tokens_per_round = Histogram("specserve_tokens_per_round", "Tokens a round yielded", _TOKENS)
        self.k = Histogram("specserve_k", "Draft tokens a round asked for", _K)
        self.verify_batch = Histogram("specserve_verify_batch_size", "Sequences in the forward pass that "
                                      "verified a round", _SIZES)
        self.draft_batch = Histogram("specserve_draft_batch_size", "Sequences per draft forward pass of a "
                                     "round's propose call", _SIZES)
        self.ttft = Histogram("specserve_ttft_seconds", "Time to the first generated token", _SECONDS)
        self.inter_token = Histogram("specserve_inter_token_seconds", "Time between generated tokens", _SECONDS)
        self.router_requests = Gauge("specserve_router_requests", "Generation requests at this router "
                                     "replica", tag_keys=("state",))
        self.adaptive_k_share = Gauge("specserve_adaptive_k_share", "Share of a method's recent rounds that chose "
                                      "k (the goodput controller's choice)", tag_keys=("method", "k"))
        self.adaptive_goodput = Gauge("specserve_adaptive_goodput_tokens_per_s", "Tokens per second of the batch "
                                      "the controller's current plan predicts")
        self.adaptive_steps = Gauge("specserve_adaptive_steps", "Forward passes per verify call in the current plan")
        self.adaptive_round_ms = Gauge("specserve_adaptive_round_ms", "A round's time, as the controller predicts "
                                       "it and as measured (averages)", tag_keys=("kind",))
        self.adaptive_error = Gauge("specserve_adaptive_model_error", "Mean |log(measured / predicted)| of the "
                                    "controller's cost models", tag_keys=("model",))
        self.adaptive_kept_share = Gauge("specserve_adaptive_kept_share", "Of the first drafts the controller's "
                                         "chosen rounds expected to keep, the share kept", tag_keys=("source",))
        self.totals = Totals()

    def round(self, outcome, rebuilt: dict[str, bool]) -> None:
        """A round's outcome (router/speculation.py RoundOutcome)."""
        drafts, verdict = len(outcome.drafts), outcome.verdict
        kind = "fallback" if outcome.fallback else (
            {"pool": "speculative", "forced": "forced"}.get(outcome.source, "lookup") if drafts else "target_only")
        self.rounds.inc(tags={"kind": kind})
        self.k.observe(outcome.k)
        _add(self.drafted, drafts)
        _add(self.accepted, verdict.accepted)
        if outcome.source == "forced":
            _add(self.forced, verdict.accepted)
        self.totals.round(drafts, verdict.accepted)
        self.tokens_per_round.observe(len(verdict.tokens))
        self.verify_batch.observe(verdict.batch_rows)
        if outcome.proposal is not None:
            self.draft_batch.observe(outcome.proposal.batch_rows)
        for pool, happened in rebuilt.items():
            if happened:
                self.rebuilds.inc(tags={"pool": pool})

    def tokens(self, count: int, first: bool, since_last_s: float) -> None:
        """`count` tokens reached the client `since_last_s` after the previous ones (or after
        the request's arrival, for the first)."""
        if count == 0:
            return
        self.generated.inc(count)
        self.totals.tokens(count)
        if first:
            self.ttft.observe(since_last_s)
            return
        for _ in range(count):   # a round's tokens arrive together: each waited its share
            self.inter_token.observe(since_last_s / count)

    def finished(self, status: int, error_type: str | None = None, count: int = 1) -> None:
        self.requests.inc(count, tags={"status": str(status)})
        self.totals.request(count)
        if error_type is not None:
            self.errors.inc(count, tags={"type": error_type})

    def gate(self, running: int, queued: int) -> None:
        self.router_requests.set(running, tags={"state": "running"})
        self.router_requests.set(queued, tags={"state": "queued"})

    def adaptive(self, state: dict) -> None:
        """The goodput controller's state, as GoodputController.describe() gives it."""
        for method, counts in state["k_by_method"].items():
            total = sum(counts.values())
            for k, count in counts.items():
                self.adaptive_k_share.set(count / total, tags={"method": method or "unknown", "k": str(k)})
        plan = state["plan"]
        if plan is not None:
            self.adaptive_goodput.set(plan["tokens_per_s"])
            self.adaptive_steps.set(plan["steps"])
        rounds = state["round_ms"]
        for kind in ("predicted", "measured"):
            if rounds[kind] is not None:
                self.adaptive_round_ms.set(rounds[kind], tags={"kind": kind})
        costs = state["costs"]
        errors = {"target_pass": costs["target_pass"]["mean_abs_log_error"],
                  "draft_pass": costs["draft_pass"]["mean_abs_log_error"],
                  "round": costs["round_mean_abs_log_error"]}
        for model, error in errors.items():
            if error is not None:
                self.adaptive_error.set(error, tags={"model": model})
        for source, shares in state["kept_share"].items():
            self.adaptive_kept_share.set(shares[0], tags={"source": source})


def _add(counter: Counter, amount: int) -> None:
    if amount > 0:          # Ray's counters refuse an increment of 0
        counter.inc(amount)
