"""The OpenAI-compatible ingress and the per-request speculation loop."""
