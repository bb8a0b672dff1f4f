"""Prometheus metrics of one server: engine gauges, token counters, latency histograms.

Each ServerMetrics owns its own CollectorRegistry, so several servers (or tests) in one
process never share counters. Engine counters arrive as cumulative values from the core
and are turned into increments here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedllm.metrics.stats import EngineStatsMsg, KVMapMsg

PROMETHEUS_CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0)


MAX_PRIORITY_LABELS = 32
"""Distinct priority values labelled on the queue-time histogram; later ones share the label 'other'
(a client choosing priorities must not grow the server's metrics without bound)."""


def counter_of(registry: CollectorRegistry, model_name: str, name: str, doc: str) -> Counter:
    return Counter(name, doc, labelnames=["model_name"], registry=registry).labels(model_name)


@dataclass(slots=True)
class _RequestTiming:
    arrival_time: float
    last_token_time: float | None = None
    priority: int = 0
    lora_name: str | None = None
    admitted: bool = False


class ServerMetrics:
    """Collects what the engine and the front end report; `render()` gives the Prometheus text."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames=list(labels), registry=r).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labelnames=list(labels), registry=r).labels(**labels)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labelnames=list(labels), buckets=buckets, registry=r).labels(**labels)

        self.num_running = gauge("pagedllm_num_requests_running", "Requests running in the engine core")
        self.num_waiting = gauge("pagedllm_num_requests_waiting", "Requests waiting for admission")
        self.kv_cache_usage = gauge("pagedllm_kv_cache_usage_ratio", "Fraction of KV blocks held by requests")
        self.kv_leaks = gauge("pagedllm_kv_cache_leaks", "Problems found by the last idle KV leak check (0 = none)")
        self.engine_healthy = gauge("pagedllm_engine_healthy", "1 while the engine core is alive, 0 once it died")
        self.prefix_queries = counter("pagedllm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("pagedllm_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.kv_disk_hits = counter("pagedllm_kv_disk_cache_hit_tokens",
                                    "Prompt tokens read back from the KV disk tier (also counted in prefix cache hits)")
        self.kv_disk_misses = counter("pagedllm_kv_disk_cache_miss_blocks",
                                      "Disk lookups after a memory miss that found no usable block")
        self.kv_disk_stored = counter("pagedllm_kv_disk_cache_stored_blocks", "Evicted KV blocks written to disk")
        self.kv_disk_corrupt = counter("pagedllm_kv_disk_cache_corrupt_blocks",
                                       "Block files that failed their check (deleted; the tokens recomputed)")
        self.kv_disk_load_s = counter("pagedllm_kv_disk_cache_load_seconds", "Time spent reading blocks from disk")
        self.kv_disk_store_s = counter("pagedllm_kv_disk_cache_store_seconds",
                                       "Time spent writing blocks to disk (off the step)")
        self.kv_disk_blocks = gauge("pagedllm_kv_disk_cache_blocks", "KV blocks on disk")
        self.kv_disk_bytes = gauge("pagedllm_kv_disk_cache_bytes", "Bytes of KV blocks on disk")
        self.kv_disk_max_bytes = gauge("pagedllm_kv_disk_cache_max_bytes", "The KV disk tier's size limit (0: off)")
        self.kv_disk_loading = gauge("pagedllm_kv_disk_cache_loading_requests", "Requests waiting for disk reads")
        self.preemptions = counter("pagedllm_num_preemptions", "Requests preempted for lack of KV blocks")
        self.prompt_tokens = counter("pagedllm_prompt_tokens", "Prompt tokens of accepted requests")
        self.generation_tokens = counter("pagedllm_generation_tokens", "Tokens generated")
        self.request_success = Counter("pagedllm_request_success", "Finished requests by finish reason",
                                       labelnames=["model_name", "finish_reason"], registry=r)
        self.requests_rejected = Counter("pagedllm_requests_rejected", "Requests the server refused or cut short, "
                                         "by reason (overloaded, timeout, shutdown)",
                                         labelnames=["model_name", "reason"], registry=r)
        self._model_name = model_name
        self.time_to_first_token = histogram("pagedllm_time_to_first_token_seconds",
                                             "Arrival to first generated token", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("pagedllm_inter_token_latency_seconds",
                                             "Time between consecutive outputs of a request", _LATENCY_BUCKETS)
        self.e2e_latency = histogram("pagedllm_e2e_request_latency_seconds",
                                     "Arrival to the last token", _E2E_BUCKETS)
        self.queue_time_by_priority = Histogram(
            "pagedllm_request_queue_time_seconds", "Arrival to first admission by the scheduler, by request priority",
            labelnames=["model_name", "priority"], buckets=_LATENCY_BUCKETS, registry=r)
        self._priority_labels: set[str] = set()
        self.beam_groups = gauge("pagedllm_beam_search_requests_running", "Beam-search requests live in the engine core")
        self.beams_running = gauge("pagedllm_beam_search_beams_running", "Beams of those requests (running or preempted)")
        self.beam_kv_blocks = gauge("pagedllm_beam_search_kv_blocks", "Distinct KV blocks the beams hold")
        self.beam_kv_blocks_saved = gauge("pagedllm_beam_search_kv_blocks_shared",
                                          "KV blocks the beams' sharing saves (block-table entries minus distinct blocks)")
        self.beam_group_preemptions = counter("pagedllm_beam_search_group_preemptions",
                                              "Beam-search requests preempted, all beams at once")
        self.structured_requests = counter("pagedllm_structured_output_requests",
                                           "Requests constrained by a JSON schema, regex, choice or grammar")
        self.grammar_cache_hits = counter("pagedllm_grammar_cache_hits",
                                          "Structured-output grammars found in the front end's cache (by text)")
        self.grammar_cache_misses = counter("pagedllm_grammar_cache_misses",
                                            "Structured-output grammars built anew by the front end")
        self._grammar_totals = (0, 0, 0)
        self.spec_steps = counter("pagedllm_spec_decode_num_steps", "Speculative decoding: request-steps with proposals")
        self.spec_draft_tokens = counter("pagedllm_spec_decode_num_draft_tokens",
                                         "Speculative decoding: proposed tokens scored")
        self.spec_accepted_tokens = counter("pagedllm_spec_decode_num_accepted_tokens",
                                            "Speculative decoding: proposed tokens kept")
        self.spec_bonus_tokens = counter("pagedllm_spec_decode_num_bonus_tokens",
                                         "Speculative decoding: tokens the model added after the kept proposals")
        self.spec_accepted_per_pos = Counter(
            "pagedllm_spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: proposals kept, by position "
            "(0 = the first proposal); divided by _proposed_ of the same position, the acceptance rate there",
            labelnames=["model_name", "position"], registry=r)
        self.spec_proposed_per_pos = Counter(
            "pagedllm_spec_decode_num_proposed_tokens_per_pos", "Speculative decoding: proposals scored, by position",
            labelnames=["model_name", "position"], registry=r)
        self._init_kv_occupancy_metrics()
        self.engine_healthy.set(1)
        self._last_stats: EngineStatsMsg | None = None
        self._init_replica_metrics()
        self._timings: dict[str, _RequestTiming] = {}
        lora_labels = ["model_name", "lora_name"]
        self.lora_requests = Counter("pagedllm_lora_requests", "Requests accepted, by LoRA adapter",
                                     labelnames=lora_labels, registry=r)
        self.lora_waiting = Gauge("pagedllm_lora_requests_waiting", "Requests not yet admitted by the scheduler, by "
                                  "LoRA adapter", labelnames=lora_labels, registry=r)
        self.lora_running = Gauge("pagedllm_lora_requests_running", "Admitted requests not finished, by LoRA adapter",
                                  labelnames=lora_labels, registry=r)

    # --- engine core ----------------------------------------------------------------------

    def record_engine_stats(self, stats: EngineStatsMsg) -> None:
        """Gauges are set; cumulative core counters become increments."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.kv_leaks.set(stats.num_kv_leaks)
        self.beam_groups.set(stats.num_beam_groups)
        self.beams_running.set(stats.num_beams_running)
        self.beam_kv_blocks.set(stats.num_beam_kv_blocks)
        self.beam_kv_blocks_saved.set(stats.num_beam_kv_blocks_saved)
        self._record_kv_occupancy(stats)
        self.kv_disk_blocks.set(stats.kv_disk_blocks)
        self.kv_disk_bytes.set(stats.kv_disk_bytes)
        self.kv_disk_max_bytes.set(stats.kv_disk_max_bytes)
        self.kv_disk_loading.set(stats.kv_disk_num_loading)
        if stats.kv_map is not None:  # one engine (with data parallelism the replicas' come one by one)
            self.kv_map_stats["0"] = stats
        last = self._last_stats
        for counter, name in ((self.prefix_queries, "prefix_cache_queries"),
                              (self.swap_outs, "num_swap_outs"),
                              (self.scheduled_tokens, "num_scheduled_tokens"),
                              (self.prefix_hits, "prefix_cache_hits"),
                              (self.kv_disk_hits, "kv_disk_hit_tokens"), (self.kv_disk_misses, "kv_disk_miss_blocks"),
                              (self.kv_disk_stored, "kv_disk_stored_blocks"),
                              (self.kv_disk_corrupt, "kv_disk_corrupt_blocks"),
                              (self.kv_disk_load_s, "kv_disk_load_seconds"),
                              (self.kv_disk_store_s, "kv_disk_store_seconds"),
                              (self.preemptions, "num_preemptions"),
                              (self.beam_group_preemptions, "num_beam_group_preemptions")):
            delta = getattr(stats, name) - (getattr(last, name) if last is not None else 0)
            if delta > 0:
                counter.inc(delta)
        self._record_spec_decode(stats, last)
        self._last_stats = stats

    def _init_kv_occupancy_metrics(self) -> None:
        r, model = self.registry, self._model_name

        def gauge(name: str, doc: str, *extra: str) -> Gauge:
            return Gauge(name, doc, labelnames=["model_name", *extra], registry=r)

        self.kv_num_blocks = gauge("pagedllm_kv_cache_num_blocks", "KV blocks on the device").labels(model)
        self.kv_blocks = gauge("pagedllm_kv_cache_blocks", "KV blocks by state: used (held by running requests), "
                               "cached (held by nobody, still holding a prefix: reclaimable), free (empty); they "
                               "add up to pagedllm_kv_cache_num_blocks", "state")
        self.kv_slots = gauge("pagedllm_kv_cache_token_slots", "Token slots of the used blocks: filled (holding KV) "
                              "or allocated (all of them); filled / allocated shows internal fragmentation", "state")
        self.kv_shared_blocks = gauge("pagedllm_kv_cache_shared_blocks",
                                      "Used KV blocks held by more than one sequence").labels(model)
        self.kv_saved_blocks = gauge("pagedllm_kv_cache_sharing_saved_blocks", "KV blocks sharing saves (parallel "
                                     "samples, beams, prefix hits): block-table entries minus distinct blocks"
                                     ).labels(model)
        self.kv_saved_bytes = gauge("pagedllm_kv_cache_sharing_saved_bytes",
                                    "Those blocks in bytes, over every tensor-parallel rank").labels(model)
        self.kv_host_blocks = gauge("pagedllm_kv_cache_swap_num_blocks", "Host blocks of swap space").labels(model)
        self.kv_swapped_blocks = gauge("pagedllm_kv_cache_swapped_blocks",
                                       "Host blocks holding swapped-out requests' KV").labels(model)
        self.kv_blocks_by_priority = gauge("pagedllm_kv_cache_blocks_by_priority", "Block-table entries of running "
                                           "requests by priority (a shared block counts once per holder)", "priority")
        self._kv_priority_labels: set[str] = set()
        self.swap_outs = counter_of(r, model, "pagedllm_num_swap_outs", "Preemptions that swapped KV to host memory")
        self.scheduled_tokens = counter_of(r, model, "pagedllm_engine_tokens_computed",
                                           "Tokens the engine computed, prompt and output (its throughput)")
        self.kv_map_stats: dict[str, EngineStatsMsg] = {}
        """Each replica's latest stats that carried a block map ('0' without data parallelism): the map and the
        gauges of the same moment, while the dashboard watches."""

    @property
    def kv_maps(self) -> dict[str, KVMapMsg]:
        """The latest block map of each replica."""
        return {replica: stats.kv_map for replica, stats in self.kv_map_stats.items()}

    def _record_kv_occupancy(self, stats: EngineStatsMsg) -> None:
        model = self._model_name
        self.kv_num_blocks.set(stats.kv_num_blocks)
        for state, value in (("used", stats.kv_num_used_blocks), ("cached", stats.kv_num_cached_blocks),
                             ("free", stats.kv_num_empty_blocks)):
            self.kv_blocks.labels(model, state).set(value)
        self.kv_slots.labels(model, "filled").set(stats.kv_num_filled_slots)
        self.kv_slots.labels(model, "allocated").set(stats.kv_num_allocated_slots)
        self.kv_shared_blocks.set(stats.kv_num_shared_blocks)
        self.kv_saved_blocks.set(stats.kv_num_saved_blocks)
        self.kv_saved_bytes.set(stats.kv_saved_bytes)
        self.kv_host_blocks.set(stats.kv_num_host_blocks)
        self.kv_swapped_blocks.set(stats.kv_num_swapped_blocks)
        by_label: dict[str, int] = {}
        for priority, num in stats.kv_blocks_by_priority.items():
            label = str(priority)
            if label not in self._kv_priority_labels:
                if len(self._kv_priority_labels) >= MAX_PRIORITY_LABELS:
                    label = "other"
                self._kv_priority_labels.add(label)
            by_label[label] = by_label.get(label, 0) + num
        for label in self._kv_priority_labels | set(by_label):
            self.kv_blocks_by_priority.labels(model, label).set(by_label.get(label, 0))

    def _record_spec_decode(self, stats: EngineStatsMsg, last: EngineStatsMsg | None) -> None:
        """Speculative-decoding counters (the core's are cumulative): increments, per position too."""
        for counter, name in ((self.spec_steps, "spec_num_steps"), (self.spec_draft_tokens, "spec_num_draft_tokens"),
                              (self.spec_accepted_tokens, "spec_num_accepted_tokens"),
                              (self.spec_bonus_tokens, "spec_num_bonus_tokens")):
            delta = getattr(stats, name) - (getattr(last, name) if last is not None else 0)
            if delta > 0:
                counter.inc(delta)
        for family, name in ((self.spec_accepted_per_pos, "spec_accepted_per_position"),
                             (self.spec_proposed_per_pos, "spec_proposed_per_position")):
            before = getattr(last, name) if last is not None else []
            for position, value in enumerate(getattr(stats, name)):
                delta = value - (before[position] if position < len(before) else 0)
                if delta > 0:
                    family.labels(model_name=self._model_name, position=str(position)).inc(delta)

    def record_engine_dead(self) -> None:
        self.engine_healthy.set(0)

    # --- requests -----------------------------------------------------------------------

    def record_request_added(self, request_id: str, num_prompt_tokens: int, arrival_time: float,
                             priority: int = 0, lora_name: str | None = None) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self._timings[request_id] = _RequestTiming(arrival_time, priority=priority, lora_name=lora_name)
        if lora_name is not None:
            self.lora_requests.labels(self._model_name, lora_name).inc()
            self.lora_waiting.labels(self._model_name, lora_name).inc()

    def record_queue_time(self, request_id: str, queue_time: float) -> None:
        """The core admitted this request `queue_time` seconds after it arrived (observed once per request)."""
        timing = self._timings.get(request_id)
        if timing is None:
            return
        self._lora_admitted(timing)
        label = str(timing.priority)
        if label not in self._priority_labels:
            if len(self._priority_labels) >= MAX_PRIORITY_LABELS:
                label = "other"
            else:
                self._priority_labels.add(label)
        self.queue_time_by_priority.labels(self._model_name, label).observe(queue_time)

    def record_new_tokens(self, request_id: str, num_tokens: int, now: float | None = None) -> None:
        """A step produced `num_tokens` tokens for this request (all of its sequences together)."""
        now = time.monotonic() if now is None else now
        self.generation_tokens.inc(num_tokens)
        timing = self._timings.get(request_id)
        if timing is None:
            return
        if timing.last_token_time is None:
            self.time_to_first_token.observe(now - timing.arrival_time)
        else:
            self.inter_token_latency.observe(now - timing.last_token_time)
        timing.last_token_time = now

    def record_request_finished(self, request_id: str, finish_reason: str | None, now: float | None = None) -> None:
        """Count a finished (or aborted: reason 'abort') request and observe its end-to-end latency."""
        now = time.monotonic() if now is None else now
        timing = self._timings.pop(request_id, None)
        if timing is None:
            return
        if timing.lora_name is not None:
            gauge = self.lora_running if timing.admitted else self.lora_waiting
            gauge.labels(self._model_name, timing.lora_name).dec()
        self.request_success.labels(self._model_name, finish_reason or "abort").inc()
        if finish_reason != "abort":
            self.e2e_latency.observe(now - timing.arrival_time)

    def _lora_admitted(self, timing: _RequestTiming) -> None:
        if timing.lora_name is not None and not timing.admitted:
            self.lora_waiting.labels(self._model_name, timing.lora_name).dec()
            self.lora_running.labels(self._model_name, timing.lora_name).inc()
        timing.admitted = True

    def record_grammar_stats(self, totals: tuple[int, int, int]) -> None:
        """(structured requests, grammar-cache hits, misses), cumulative (InputProcessor.grammar_stats):
        counted as increments."""
        for counter, now, before in zip((self.structured_requests, self.grammar_cache_hits, self.grammar_cache_misses),
                                        totals, self._grammar_totals):
            if now > before:
                counter.inc(now - before)
        self._grammar_totals = tuple(max(a, b) for a, b in zip(totals, self._grammar_totals))

    def record_rejected(self, reason: str) -> None:
        """Count a request refused at admission (429), aborted at its deadline, or ended by a shutdown."""
        self.requests_rejected.labels(self._model_name, reason).inc()

    # --- data-parallel replicas (label `replica`; the unlabelled metrics above are the totals) ------

    def _init_replica_metrics(self) -> None:
        r = self.registry
        labels = ["model_name", "replica"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labelnames=labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labelnames=[*labels, *extra], registry=r)

        self.replica_up = gauge("pagedllm_replica_up", "1 while a data-parallel engine replica serves, else 0")
        self.replica_running = gauge("pagedllm_replica_num_requests_running", "Requests running in a replica")
        self.replica_waiting = gauge("pagedllm_replica_num_requests_waiting", "Requests waiting in a replica")
        self.replica_kv_usage = gauge("pagedllm_replica_kv_cache_usage_ratio", "Fraction of a replica's KV blocks held")
        self.replica_kv_blocks = Gauge("pagedllm_replica_kv_cache_blocks", "A replica's KV blocks by state (used, "
                                       "cached, free)", labelnames=[*labels, "state"], registry=r)
        self.replica_kv_leaks = gauge("pagedllm_replica_kv_cache_leaks", "Problems found by a replica's last idle "
                                      "KV leak check")
        self.replica_prefix_queries = counter("pagedllm_replica_prefix_cache_queries",
                                              "Prompt tokens a replica looked up in its prefix cache")
        self.replica_prefix_hits = counter("pagedllm_replica_prefix_cache_hits",
                                           "Prompt tokens a replica found in its prefix cache")
        self.routing_decisions = counter("pagedllm_routing_decisions", "Requests routed to a replica, by reason "
                                         "(least_loaded, affinity_hit, affinity_miss, affinity_overloaded)",
                                         ("reason",))
        self.replica_requests_lost = counter("pagedllm_replica_requests_lost", "In-flight requests of a replica "
                                             "that died: retried elsewhere (no token sent yet) or failed",
                                             ("outcome",))
        self.replica_restarts = counter("pagedllm_replica_restarts", "Times a replica came back after dying")
        self._last_replica_stats: dict[str, EngineStatsMsg] = {}

    def record_replica_up(self, replica: str, up: bool) -> None:
        self.replica_up.labels(self._model_name, replica).set(1 if up else 0)
        if not up:  # a restarted core counts from zero again
            self._last_replica_stats.pop(replica, None)
            self.kv_map_stats.pop(replica, None)

    def record_replica_stats(self, replica: str, stats: EngineStatsMsg) -> None:
        """One replica's own stats (the totals go through record_engine_stats)."""
        key = (self._model_name, replica)
        self.replica_running.labels(*key).set(stats.num_running)
        self.replica_waiting.labels(*key).set(stats.num_waiting)
        self.replica_kv_usage.labels(*key).set(stats.kv_cache_usage)
        self.replica_kv_leaks.labels(*key).set(stats.num_kv_leaks)
        for state, value in (("used", stats.kv_num_used_blocks), ("cached", stats.kv_num_cached_blocks),
                             ("free", stats.kv_num_empty_blocks)):
            self.replica_kv_blocks.labels(*key, state).set(value)
        if stats.kv_map is not None:
            self.kv_map_stats[replica] = stats
        last = self._last_replica_stats.get(replica)
        for counter, name in ((self.replica_prefix_queries, "prefix_cache_queries"),
                              (self.replica_prefix_hits, "prefix_cache_hits")):
            delta = getattr(stats, name) - (getattr(last, name) if last is not None else 0)
            if delta > 0:
                counter.labels(*key).inc(delta)
        self._last_replica_stats[replica] = stats

    def record_routing(self, replica: str, reason: str) -> None:
        self.routing_decisions.labels(self._model_name, replica, reason).inc()

    def record_replica_request_lost(self, replica: str, outcome: str) -> None:
        self.replica_requests_lost.labels(self._model_name, replica, outcome).inc()

    def record_replica_restart(self, replica: str) -> None:
        self.replica_restarts.labels(self._model_name, replica).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
