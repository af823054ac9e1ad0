"""llama.cpp's server on the same GGUF file, as closed-loop clients meet it: what a CPU user
would otherwise run.

The server is PyPI's `xllamacpp` (llama.cpp's own server, built as a Python module), run in
the benchmark's process with as many threads as torch uses and a slot per client, fed the same
prompt token ids with the same sampling settings and seeds, streaming. It multiplies by the
file's 4-bit blocks with its activations quantized to 8 bits, so its answers are not the
float32 model's: its rows report no exactness. `llamacpp_ngram` adds its own speculation
(`ngram_mod`: drafts looked up in the text so far), the counterpart of batchspec's n-gram draft.
"""
import contextlib
import queue
import threading

# method -> llama.cpp speculation type (None: plain decoding)
METHODS = {"llamacpp": None, "llamacpp_ngram": "COMMON_SPECULATIVE_TYPE_NGRAM_MOD"}


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("xllamacpp") is not None


def gguf_path(target: str) -> str:
    """The GGUF file a target names (the default model, or a .gguf path); ValueError for a
    target that is not one."""
    import pathlib

    from batchspec.runtime import models

    source = models.resolve(target)
    if source.gguf_file is None:
        raise ValueError(f"the llama.cpp methods serve a GGUF file; {target} is not one")
    return str(pathlib.Path(source.path) / source.gguf_file)


@contextlib.contextmanager
def served(workload, method: str, clients: int, threads: int):
    """A stub over a fresh llama.cpp server for `workload`'s target, as closed_loop.served's."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = gguf_path(workload.target)
    params.n_parallel = max(clients, 1)
    longest = max(len(p) for p in workload.prompts) + workload.max_new_tokens
    params.n_ctx = params.n_parallel * (longest + 16)  # each slot gets n_ctx / n_parallel
    params.cpuparams.n_threads = params.cpuparams_batch.n_threads = threads
    kind = METHODS[method]
    if kind is not None:
        params.speculative.types = [getattr(xllamacpp.common_speculative_type, kind)]
    server = xllamacpp.Server(params)
    try:
        yield Stub(server)
    finally:
        del server


class Stub:
    """Generate(request) as batchspec's Coordinator stub answers it: streamed responses whose
    token_ids stand for the tokens each chunk carried (their ids are not reported: zeros)."""

    def __init__(self, server):
        self.server = server

    def Generate(self, request, timeout=None):  # noqa: N802 (the gRPC method's name)
        from batchspec.v1 import generate_pb2

        body = {"prompt": list(request.prompt_token_ids), "n_predict": request.max_new_tokens,
                "stream": True, "cache_prompt": False,
                "temperature": request.temperature if request.HasField("temperature") else 0.0}
        if request.HasField("top_p"):
            body["top_p"] = request.top_p
        if request.HasField("seed"):
            body["seed"] = request.seed
        chunks: queue.Queue = queue.Queue()

        def run():
            try:
                self.server.handle_completions(body, chunks.put)
            finally:
                chunks.put(None)

        threading.Thread(target=run, daemon=True).start()
        sent = 0
        while (chunk := chunks.get(timeout=timeout)) is not None:
            if "error" in chunk:
                raise RuntimeError(f"llama.cpp: {chunk['error']}")
            # a token a chunk until the last, which says how many there were in all (a chunk
            # may hold back the bytes of an unfinished character for the next)
            count = chunk["usage"]["completion_tokens"] - sent if "usage" in chunk else 1
            if count > 0:
                sent += count
                yield generate_pb2.GenerateResponse(token_ids=[0] * count)
