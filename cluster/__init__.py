"""Cluster side of specserve: configuration, app building, CLI and entrypoints."""
