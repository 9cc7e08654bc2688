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
import subprocess
from pathlib import Path
from typing import Iterator

from cluster.bench.vllm_server import _stop, _wait_ready
from cluster.ports import free_port

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


@contextlib.contextmanager
def llama_servers(binary: str, target: Path, draft: Path | None, k: int, slots: int, context: int,
                  threads: int | None, repack: bool, log_folder: Path,
                  modes: tuple[str, ...] = MODES) -> Iterator[dict[str, str]]:
    """The servers of `modes` (the draft one only with a draft), one after the other; yields
    {mode: base URL}; each server's output goes to a log in log_folder."""
    log_folder.mkdir(parents=True, exist_ok=True)
    processes: list[subprocess.Popen] = []
    urls: dict[str, str] = {}
    try:
        for mode in modes:
            if mode == "llamacpp_serve_draft" and draft is None:
                continue
            port = free_port()
            log = log_folder / f"{mode}.log"
            process = subprocess.Popen(server_command(binary, target, draft, mode, k, port, slots, context, threads,
                                                      repack),
                                       stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
            processes.append(process)
            urls[mode] = f"http://127.0.0.1:{port}"
            print(f"bench: starting llama-server ({mode}) on port {port}, log {log}", flush=True)
            _wait_ready(urls[mode], process, log)
        yield urls
    finally:
        for process in processes:
            _stop(process)
