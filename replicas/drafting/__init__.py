"""Drafting by lookup, shared by the router (router/draft_sources.py) and the vLLM target
engine's proposer (replicas/engines/vllm/lookup_proposer.py): prompt lookup in the sequence
(lookup.py) and suffix drafting from it and recent outputs (suffix.py). Imports nothing above
replicas/."""
