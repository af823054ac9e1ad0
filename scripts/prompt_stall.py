#!/usr/bin/env python3
"""How long a long prompt holds up the streams already running on a server.

Streams STREAMS greedy completions of MAX_TOKENS each from a server's OpenAI edge
(`batchspec serve --http-port PORT`), sends one prompt of about PROMPT_WORDS words while they
run, and reports that prompt's time to first token and, for the running streams, the median
and the longest gap between two tokens (the longest is the stall), over ROUNDS rounds
(`--streams 0`: the prompt alone, its time to first token):

    python3 scripts/prompt_stall.py --port 8000 [--prompt-words 2400] [--rounds 3]
"""
import argparse
import json
import statistics
import threading
import time
import urllib.request

WORDS = "the quick brown fox jumps over the lazy dog".split()


def stream(port: int, body: dict) -> tuple[float, list[float]]:
    """(when it was sent, when each chunk arrived) of one streamed completion."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    sent, arrived = time.time(), []
    with urllib.request.urlopen(request, timeout=900) as response:
        for line in response:
            if line.startswith(b"data: {"):
                arrived.append(time.time())
    return sent, arrived


def one_round(port: int, streams: int, max_tokens: int, words: int) -> dict:
    running = [None] * streams

    def run(i):
        running[i] = stream(port, {"prompt": f"Story {i}: once upon a time",
                                   "max_tokens": max_tokens, "temperature": 0,
                                   "ignore_eos": True})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    time.sleep(2.0 if streams else 0.0)  # the streams decode
    sent, arrived = stream(port, {"prompt": " ".join(WORDS[i % len(WORDS)]
                                                     for i in range(words)),
                                  "max_tokens": 4, "temperature": 0})
    for thread in threads:
        thread.join()
    gaps = [b - a for _, times in running for a, b in zip(times, times[1:])]
    if not gaps:  # the prompt alone
        return {"ttft_s": arrived[0] - sent}
    return {"ttft_s": arrived[0] - sent, "median_gap_ms": 1000 * statistics.median(gaps),
            "longest_gap_s": max(gaps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the server's HTTP port")
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=300,
                        help="tokens each running stream decodes (outlasting the long prompt)")
    parser.add_argument("--prompt-words", type=int, default=2400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds = [one_round(args.port, args.streams, args.max_tokens, args.prompt_words)
              for _ in range(args.rounds)]
    for key in rounds[0]:
        values = sorted(r[key] for r in rounds)
        print(f"{key}: median {statistics.median(values):.2f} "
              f"(rounds: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
