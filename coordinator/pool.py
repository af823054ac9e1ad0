"""The request pool of one engine: requests waiting for a slot, and the active ones.

Request threads submit and cancel; the engine thread admits, steps and ends. Invariants:
- a handle is in at most one of `waiting` and `active`; `active` is keyed by sequence id;
- only the engine thread adds to or removes from `active`; `waiting` changes under the lock;
- at most `max_num_seqs` sequences are active, at most `max_queue` wait (beyond it a submit is
  refused at once with RESOURCE_EXHAUSTED).
"""
import itertools
import threading

from batchspec import errors
from batchspec.params import SamplingParams
from coordinator import scheduler
from coordinator.requests import RequestHandle
from coordinator.sequence import Sequence


class RequestPool:
    def __init__(self, max_num_seqs: int, max_queue: int, eos_token_ids: list[int],
                 seq_ids=None):
        self.max_num_seqs = max_num_seqs
        self.max_queue = max_queue
        self.eos_token_ids = frozenset(eos_token_ids)
        # sequence ids are unique across every engine of a router (they share the counter)
        self._ids = seq_ids if seq_ids is not None else itertools.count(1)
        self._lock = threading.Condition()
        self.waiting: list[RequestHandle] = []
        self.active: dict[int, RequestHandle] = {}
        self.stopping = False  # new requests are refused

    def submit(self, prompt_token_ids: list[int], max_new_tokens: int,
               sampling: SamplingParams = SamplingParams(), *, ignore_eos: bool = False,
               deadline: float | None = None, text=None, events=None,
               logprobs: int | None = None, prompt_logprobs: int | None = None,
               constraint=None) -> RequestHandle:
        """Queue a request. text: a coordinator.text.TextStream that turns its tokens into
        text and finds its stop strings, on the engine thread; events: see RequestHandle;
        logprobs, prompt_logprobs, constraint: see Sequence."""
        seq = Sequence(next(self._ids), list(prompt_token_ids), max_new_tokens,
                       frozenset() if ignore_eos else self.eos_token_ids, sampling, text=text,
                       logprobs=logprobs, prompt_logprobs_top=prompt_logprobs,
                       constraint=constraint)
        handle = RequestHandle(seq, deadline, events)
        with self._lock:
            if self.stopping:
                raise errors.Unavailable("the coordinator is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise errors.ResourceExhausted(
                    f"{len(self.waiting)} requests already wait; retry later")
            self.waiting.append(handle)
            self._lock.notify_all()
        return handle

    def wake(self) -> None:
        """Wake the engine thread (a cancellation, a stop)."""
        with self._lock:
            self._lock.notify_all()

    def refuse_new(self) -> None:
        """From now on every submit is refused (the coordinator is stopping)."""
        with self._lock:
            self.stopping = True
            self._lock.notify_all()

    def wait_for_work(self, still_idle) -> None:
        """Block the engine thread while nothing waits or runs and still_idle() holds (checked
        at least every second and whenever the pool changes)."""
        with self._lock:
            while self.idle() and still_idle():
                self._lock.wait(timeout=1.0)

    def requeue(self, handles: list[RequestHandle]) -> None:
        """Put handles back at the head of the queue (adopted, or not admitted after all)."""
        with self._lock:
            self.waiting = list(handles) + self.waiting
            self._lock.notify_all()

    def next_admission(self, max_prefill_tokens: int,
                       max_count: int | None = None) -> list[RequestHandle]:
        """Take the next run of waiting requests (at most max_count) that fits the pool and
        one prefill command. A request whose prompt an active sequence caches whole costs
        no prefill tokens (its cache is copied: peers.shared_prompts); one whose prompt an
        active sequence is still being fed in chunks waits until that one holds it whole,
        then is copied (the prompt is fed once), while the requests behind it go ahead."""
        with self._lock:
            room = self.max_num_seqs - len(self.active)
            if max_count is not None:
                room = min(room, max_count)
            active = [h.seq for h in self.active.values() if h.seq.target.cache_len is not None]
            fed = [s for s in active if s.prefilling]
            held = [s for s in active if not s.prefilling]
            ready = [h for h in self.waiting if not any(h.seq.shares_prompt(s) for s in fed)
                     ][:room] if fed else self.waiting[:room]
            copied = frozenset(h.seq.seq_id for h in ready
                               if any(h.seq.shares_prompt(s) for s in held))
            runs = scheduler.split_by_tokens([h.seq for h in ready], max_prefill_tokens,
                                             copied)
            taken = ready[:len(runs[0]) if runs else 0]
            ids = {id(h) for h in taken}
            self.waiting = [h for h in self.waiting if id(h) not in ids]
        return taken

    def activate(self, handle: RequestHandle) -> None:
        self.active[handle.seq.seq_id] = handle

    def deactivate(self, seq: Sequence) -> None:
        self.active.pop(seq.seq_id, None)

    def unqueue(self, handle: RequestHandle) -> None:
        with self._lock:
            if handle in self.waiting:
                self.waiting.remove(handle)

    def handles(self) -> list[RequestHandle]:
        """Every request, active first."""
        with self._lock:
            return list(self.active.values()) + self.waiting

    def take_all(self, handles: list[RequestHandle]) -> None:
        """Remove `handles` (moved to another engine) from this pool."""
        with self._lock:
            for handle in handles:
                self.active.pop(handle.seq.seq_id, None)
            self.waiting = [h for h in self.waiting if h not in handles]

    def handles_of(self, seqs: list[Sequence]) -> list[RequestHandle]:
        return [self.active[s.seq_id] for s in seqs if s.seq_id in self.active]

    def active_sequences(self) -> list[Sequence]:
        return [h.seq for h in self.active.values()]

    def decoding(self) -> bool:
        """Whether an active sequence is stepped (not one whose prompt is still being fed)."""
        return any(not h.seq.prefilling for h in self.active.values())

    def prefilling(self) -> Sequence | None:
        """The oldest active sequence whose prompt the target holds in part."""
        return next((h.seq for h in self.active.values() if h.seq.prefilling), None)

    def num_running(self) -> int:
        return len(self.active)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def load(self) -> int:
        return len(self.active) + len(self.waiting)

    def idle(self) -> bool:
        return not (self.active or self.waiting)
