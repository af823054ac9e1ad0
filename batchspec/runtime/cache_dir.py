"""Where batchspec keeps what it makes once per machine and reuses in every process: the
user cache ($XDG_CACHE_HOME, else ~/.cache), and how a process reads, writes and takes its
turn at what is kept there."""
import contextlib
import fcntl
import json
import os
import pathlib


def user_cache_dir() -> pathlib.Path:
    """batchspec's folder in the user cache."""
    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    return root / "batchspec"


def measured_dir() -> pathlib.Path:
    """Where what a process measures of the machine is kept: $BATCHSPEC_MEASURED_DIR (a
    container's volume, so that a recreated container does not time its machine again), else
    batchspec's user cache folder."""
    given = os.environ.get("BATCHSPEC_MEASURED_DIR")
    return pathlib.Path(given) if given else user_cache_dir()


def kernel_plans_file() -> pathlib.Path:
    """Where the CPU kernel plans of batchspec.runtime.fastlinear are kept for every process."""
    return measured_dir() / "kernel-plans.json"


def step_costs_file() -> pathlib.Path:
    """Where the forward costs measured at start-up (batchspec.runtime.calibration) are kept."""
    return measured_dir() / "step-costs.json"


@contextlib.contextmanager
def timing_alone(store: pathlib.Path):
    """Hold the store's lock file (exclusive), so processes that start together (a target and
    its drafts) time one after another: neither times while the other loads the cores with
    its own timing, and the later one reads what the first stored. Without a lock file that
    can be made, go on unlocked."""
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        handle = open(store.with_name(store.name + ".lock"), "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def read_json(store: pathlib.Path) -> dict:
    """A store's entries; {} where there is none yet or it cannot be read (measure again)."""
    try:
        stored = json.loads(store.read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def write_json(store: pathlib.Path, stored: dict) -> None:
    """Written whole under a temporary name, then renamed: a reader never sees half a file.
    A store that cannot be written only means measuring again next time."""
    tmp = store.with_name(f"{store.name}.tmp{os.getpid()}")
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(stored, indent=1, sort_keys=True))
        os.replace(tmp, store)
    except OSError:
        tmp.unlink(missing_ok=True)
