"""Closed-loop clients of a served free model: python3 free_client.py PORT CLIENTS REQUESTS."""
import concurrent.futures
import random
import sys
import time

import grpc

from batchspec.v1 import generate_pb2, generate_pb2_grpc

port, clients, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
stub = generate_pb2_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
rng = random.Random(0)


def one(_):
    got = 0
    for _ in range(n):
        prompt = [rng.randrange(4, 90) for _ in range(12)]
        for response in stub.Generate(generate_pb2.GenerateRequest(
                prompt_token_ids=prompt, max_new_tokens=96, ignore_eos=True)):
            got += len(response.token_ids)
    return got


one(0)  # untimed
started = time.perf_counter()
with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    total = sum(pool.map(one, range(clients)))
seconds = time.perf_counter() - started
print(f"clients {clients}: {total / seconds:.0f} tok/s, "
      f"{1000 * seconds / total * clients:.2f} ms a row's token")
