"""batchspec: batch speculative decoding, served."""
import os

# How long torch's OpenMP workers spin after a CPU kernel before they sleep. libgomp's default
# (300,000 rounds) keeps an idle model service's workers spinning on the cores that the other
# service needs next: where the services share a few cores, that cost about a fifth of the
# throughput against 1,000 to 100,000 rounds, while one process alone runs as fast with 10,000.
# Set before torch loads (any batchspec import comes first); a value already in the environment
# wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
