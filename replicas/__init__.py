"""Model replicas: loading, KV caches, draft proposal, target verification, deployments."""
