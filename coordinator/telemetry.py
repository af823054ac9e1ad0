"""Feeds engine events into Prometheus metrics (or nowhere, when metrics are off)."""
import time

from batchspec.metrics import CoordinatorMetrics


class Telemetry:
    def __init__(self, metrics: CoordinatorMetrics | None = None):
        self.metrics = metrics

    def watch_queue(self, num_running, num_waiting) -> None:
        """The queue gauges read these functions (over every engine) when scraped."""
        if self.metrics:
            self.metrics.requests_running.set_function(num_running)
            self.metrics.requests_waiting.set_function(num_waiting)

    def admitted(self, num_prompt_tokens: int) -> None:
        if self.metrics:
            self.metrics.prompt_tokens.inc(num_prompt_tokens)

    def step(self, mixed: bool, fallback: bool, draft_s: float | None, verify_s: float,
             realign_s: float) -> None:
        """draft_s: None when the step made no draft call (no draft service, or K = 0)."""
        m = self.metrics
        if not m:
            return
        (m.realigned_steps if mixed else m.grouped_steps).inc()
        if fallback:
            m.draft_fallback_steps.inc()
        if draft_s is not None:
            m.draft_seconds.observe(draft_s)
        m.verify_seconds.observe(verify_s)
        if mixed:
            m.realign_seconds.observe(realign_s)

    def prefilled(self, seconds: float) -> None:
        if self.metrics:
            self.metrics.prefill_seconds.observe(seconds)

    def committed(self, handle, num_tokens: int, drafts) -> None:
        """drafts: (drafts verified, of them accepted) of each verify the row's step ran (a
        verify of rounds: one a round)."""
        now = time.monotonic()
        m = self.metrics
        if m and num_tokens:
            if handle.first_token_at is None:
                m.time_to_first_token.observe(now - handle.arrival)
            else:
                gap = (now - handle.last_token_at) / num_tokens
                for _ in range(num_tokens):
                    m.inter_token_latency.observe(gap)
            m.generation_tokens.inc(num_tokens)
        if num_tokens:
            handle.first_token_at = handle.first_token_at or now
            handle.last_token_at = now
        for num_drafts, num_accepted in drafts if m else ():
            if num_drafts:
                m.num_drafts.inc()
                m.num_draft_tokens.inc(num_drafts)
                m.num_accepted_tokens.inc(num_accepted)
                for position in range(min(num_accepted, len(m.accepted_per_pos))):
                    m.accepted_per_pos[position].inc()

    def finished(self, handle) -> None:
        if self.metrics:
            self.metrics.e2e_latency.observe(time.monotonic() - handle.arrival)

    def failed(self) -> None:
        if self.metrics:
            self.metrics.failed_requests.inc()
