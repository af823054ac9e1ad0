"""Prometheus metrics. Names follow vLLM's where vLLM has the same thing, so existing
dashboards work; what is ours is prefixed `batchspec:`. Each process (or test) builds its
own registry: no module-global state."""
import prometheus_client as prom

from batchspec import errors

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
                   60.0)


class CoordinatorMetrics:
    def __init__(self, model_name: str, max_draft_positions: int = 32):
        self.registry = prom.CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return prom.Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return prom.Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name, doc):
            return prom.Histogram(name, doc, labels, buckets=LATENCY_BUCKETS,
                                  registry=r).labels(model_name)

        self.requests_running = gauge("vllm:num_requests_running",
                                      "Requests in the pool being stepped.")
        self.requests_waiting = gauge("vllm:num_requests_waiting",
                                      "Requests waiting for a pool slot.")
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Time from arrival to the first committed token.")
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Time between committed tokens of a request.")
        self.e2e_latency = histogram("vllm:e2e_request_latency_seconds",
                                     "Time from arrival to the end of a request.")
        self.num_drafts = counter("vllm:spec_decode_num_drafts",
                                  "Draft proposals verified (one per sequence per verify; a "
                                  "command of rounds verifies one a round).")
        self.num_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens.")
        self.num_accepted_tokens = counter("vllm:spec_decode_num_accepted_tokens",
                                           "Accepted drafted tokens.")
        per_pos = prom.Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                               "Accepted drafted tokens by position in the draft.",
                               labels + ["position"], registry=r)
        self.accepted_per_pos = [per_pos.labels(model_name, str(i))
                                 for i in range(max_draft_positions)]
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens admitted.")
        self.grouped_steps = counter("batchspec:grouped_steps",
                                     "Steps over a group of equal lengths (aligned rows).")
        self.realigned_steps = counter("batchspec:realigned_steps",
                                       "Steps over a group of mixed lengths (masked, or copied).")
        self.draft_fallback_steps = counter("batchspec:draft_fallback_steps",
                                            "Steps decoded with the target alone (draft down).")
        self.realign_seconds = histogram("batchspec:realign_seconds",
                                         "Time the services spent on unaligned rows, per step.")
        self.draft_seconds = histogram("batchspec:draft_seconds",
                                       "Draft proposal round trip, per step.")
        self.verify_seconds = histogram("batchspec:verify_seconds",
                                        "Target verification round trip, per step.")
        self.prefill_seconds = histogram("batchspec:prefill_seconds",
                                         "Prefill round trip (target or draft), per admission.")
        self.failed_requests = counter("batchspec:failed_requests",
                                       "Requests ended by an error, cancellation or deadline.")


class ServiceMetrics:
    def __init__(self, role: str):
        self.registry = prom.CollectorRegistry()
        self.sequences = prom.Gauge("batchspec:cached_sequences", "Sequences with a KV cache.",
                                    ["role"], registry=self.registry).labels(role)
        self.cached_tokens = prom.Gauge("batchspec:cached_tokens", "Cached positions, summed.",
                                        ["role"], registry=self.registry).labels(role)
        self.command_seconds = prom.Histogram(
            "batchspec:command_seconds", "Time to run one command.", ["role", "command"],
            buckets=LATENCY_BUCKETS, registry=self.registry)
        self.role = role

    def observe(self, kind: str, seconds: float, runner) -> None:
        self.command_seconds.labels(self.role, kind).observe(seconds)
        self.sequences.set(len(runner.caches))
        self.cached_tokens.set(runner.num_cached_tokens())


def serve_metrics(registry, port: int, host: str = "127.0.0.1"):
    """Expose a registry on http://host:port/metrics; returns the HTTP server (port 0 picks
    a free port: read server.server_port). OSError naming the address where it is taken."""
    try:
        server, _thread = prom.start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise errors.address_refused("metrics", host, port, error) from None
    return server


def scrape(url: str, timeout: float = 10.0) -> list[tuple[str, dict, float]]:
    """(sample name, labels, value) of every sample a /metrics endpoint serves, parsed by
    prometheus_client's own parser."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    body = urllib.request.urlopen(url, timeout=timeout).read().decode()
    return [(sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(body) for sample in family.samples]
