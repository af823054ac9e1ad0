"""The tools that drive batchspec's processes: the `batchspec` command line, the benchmark,
draft training, and the prompt sets they use. Above the three processes; nothing imports it."""
