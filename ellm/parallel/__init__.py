"""Tensor parallelism on CPUs: one TVM Disco worker per NUMA node or machine, each holding a slice of the model
(shard.py), joined by eLLM's CPU collective (ccl.py) after every row-parallel matmul."""
