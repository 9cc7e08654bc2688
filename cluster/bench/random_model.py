"""A random-weight Llama of a real size, made from code, for measuring what does not depend on
the weights' values: start-up time, a step's time, memory. No hub: the shapes are written
here and the tokenizer is the bundled one's (so the router and the bundled draft share it).

    python -m cluster.bench.random_model /tmp/llama-1b --size 1b

Sizes: `1b` has TinyLlama-1.1B's layer shapes (22 layers, hidden 2048, intermediate 5632,
32 heads, 4 key/value heads) over the bundled 512-token vocabulary: 0.97 B parameters,
3.9 GB in float32. `small` (12 layers, hidden 768) has 81 M, 0.3 GB: a target whose load
takes seconds, for tests of a start. `tiny` is a few MB.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4),
    "small": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}
_BUNDLED_TARGET = Path(__file__).resolve().parents[2] / "models" / "target"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def make(out: Path, size: str, tokenizer_from: Path = _BUNDLED_TARGET, seed: int = 0) -> Path:
    """Write a random-weight Llama of `size` with the tokenizer of `tokenizer_from` to `out`."""
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    bundled = AutoConfig.from_pretrained(tokenizer_from, local_files_only=True)
    config = LlamaConfig(vocab_size=bundled.vocab_size, max_position_embeddings=bundled.max_position_embeddings,
                         bos_token_id=bundled.bos_token_id, eos_token_id=bundled.eos_token_id,
                         pad_token_id=getattr(bundled, "pad_token_id", None), tie_word_embeddings=False,
                         rms_norm_eps=1e-5, **SIZES[size])
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in _TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    args = parser.parse_args()
    started = time.perf_counter()
    make(args.out, args.size)
    print(f"wrote {args.out} ({args.size}) in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
