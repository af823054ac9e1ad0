"""The one thread of a model service that runs torch.

torch's CPU build runs its parallel kernels on GNU OpenMP. Each OS thread that starts a
parallel region gets its own team of workers, and libgomp lets workers spin between regions
(what keeps a decode step's hundreds of small regions fast) only while the process holds no more
OpenMP threads than cores. A model loaded on the main thread and then run from a gRPC handler
thread makes two teams, and from then on every worker sleeps between regions, so a decode step
runs slower on a second thread after a warm-up on the main one than when one thread does
everything. So a service loads, tunes and runs its model on this one thread, and its handler
threads hand their commands to it.

Invariant: in a service process, every torch call goes through `run`.
"""
import concurrent.futures
import threading

_ident: int | None = None


def _mark() -> None:
    global _ident
    _ident = threading.get_ident()


# One worker, started on first use and kept for the life of the process.
_executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute",
                                                  initializer=_mark)


def run(fn, /, *args, **kwargs):
    """fn(*args, **kwargs) on the compute thread: its result, or its exception raised here.
    Called from the compute thread itself, it runs fn directly (no deadlock)."""
    if threading.get_ident() == _ident:
        return fn(*args, **kwargs)
    return _executor.submit(fn, *args, **kwargs).result()


def thread_ident() -> int | None:
    """The compute thread's id, or None before its first use."""
    return _ident
