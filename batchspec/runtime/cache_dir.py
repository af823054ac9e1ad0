"""Where batchspec keeps what it makes once per machine and reuses in every process: the
user cache ($XDG_CACHE_HOME, else ~/.cache)."""
import os
import pathlib


def user_cache_dir() -> pathlib.Path:
    """batchspec's folder in the user cache."""
    root = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache"))
    return root / "batchspec"


def kernel_plans_file() -> pathlib.Path:
    """Where the CPU kernel plans of batchspec.runtime.fastlinear are kept for every process."""
    return user_cache_dir() / "kernel-plans.json"
