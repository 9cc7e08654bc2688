"""`specserve bench --llama-server BINARY`: llama.cpp's own OpenAI server (`llama-server`) on the
same GGUF files as the cluster's llama.cpp pools, driven by the bench's own load generator in
every phase beside specserve's modes: one run, the same client, prompts and closed loop.

Up to three servers, started one after the other and stopped at the end, each with as many
parallel slots as the largest load (`-np`) and a context of `context_length` per slot:
- `llamacpp_serve_alone`: the target alone;
- `llamacpp_serve_draft`: speculating with the draft GGUF (`--spec-type draft-simple`, up to k
  drafts a round), where the cluster has a draft model;
- `llamacpp_serve_ngram`: speculating by its own prompt lookup (`--spec-type ngram-simple`).
Build it from the llama.cpp source that llama-cpp-python vendors (README, "The llama.cpp
engine"), so that both run the same llama.cpp.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from cluster.bench.other_servers import running_servers

SERVED_NAME = "specserve-pair"
MODES = ("llamacpp_serve_alone", "llamacpp_serve_draft", "llamacpp_serve_ngram")


def server_command(binary: str, target: Path, draft: Path | None, mode: str, k: int, port: int, slots: int,
                   context: int, threads: int | None, repack: bool) -> list[str]:
    command = [binary, "-m", str(target), "--alias", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
               "-np", str(slots), "-c", str(slots * context), "--no-webui"]
    if threads is not None:
        command += ["-t", str(threads), "-tb", str(threads)]
    if not repack:
        command.append("--no-repack")
    if mode == "llamacpp_serve_draft":
        command += ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(k)]
        if threads is not None:
            command += ["-td", str(threads), "-tbd", str(threads)]
    elif mode == "llamacpp_serve_ngram":
        command += ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(k)]
    return command


def llama_servers(binary: str, target: Path, draft: Path | None, k: int, slots: int, context: int,
                  threads: int | None, repack: bool, log_folder: Path,
                  modes: tuple[str, ...] = MODES) -> contextlib.AbstractContextManager[dict[str, str]]:
    """The servers of `modes` (the draft one only with a draft), one after the other; yields
    {mode: base URL}; each server's output goes to a log in log_folder."""
    commands = {mode: (lambda port, mode=mode: server_command(binary, target, draft, mode, k, port, slots, context,
                                                              threads, repack))
                for mode in modes if mode != "llamacpp_serve_draft" or draft is not None}
    return running_servers(commands, "llama-server", log_folder)
