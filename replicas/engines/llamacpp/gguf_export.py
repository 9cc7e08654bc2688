"""A Hugging Face Llama folder written as a GGUF file, with the `gguf` package (the GGUF
format's own writer, kept in llama.cpp's tree): the bundled pair, or a random-weight model of
a real size (cluster/bench/random_model.py), as llama.cpp loads them. No hub: the weights and
the tokenizer come from the folder.

    python -m replicas.engines.llamacpp.gguf_export models/target /tmp/target-f32.gguf --type f32

Why not llama.cpp's convert_hf_to_gguf.py: it is not installed with llama-cpp-python, and it
refuses a byte-level BPE tokenizer whose pre-tokenizer it does not recognise by hash (the
bundled models' own). The router tokenizes with the folder's tokenizer and sends token ids,
so the file's vocabulary needs only to name the same tokens under the same ids
(replicas/engines/llamacpp/vocabulary.py checks it at start); its pre-tokenizer is written as
GPT-2's, which the bundled tokenizer's byte-level splitting is.

The one transformation: llama.cpp's LLAMA architecture rotates each head's dimensions as
interleaved pairs (0,1), (2,3), ..., where transformers' Llama rotates the first half against
the second. Rows of the query and key projections are reordered so that both compute the
same attention: within each head, row i of the first half and row i of the second half
become rows 2i and 2i + 1.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

import gguf

QUANT_TYPES = {
    "f32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "f16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "bf16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}

# transformers' names within a layer -> GGUF's (llama.cpp's LLAMA architecture)
_LAYER_TENSORS = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def interleaved_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A q or k projection's rows [heads * head_dim, hidden] reordered from transformers'
    half-split rotation to llama.cpp's interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name of a transformers Llama weight."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")          # model.layers.{i}.{module...}.weight
    if parts[:2] != ["model", "layers"]:
        raise ValueError(f"unexpected tensor {hf_name}")
    module = ".".join(parts[3:-1])
    if module not in _LAYER_TENSORS:
        raise ValueError(f"unexpected tensor {hf_name}")
    return f"blk.{parts[2]}.{_LAYER_TENSORS[module]}.weight"


def export(folder: Path, out: Path, quant: str = "f32") -> Path:
    """Write the Llama in `folder` (config.json, safetensors, tokenizer.json) to `out`, whole
    or not at all: written beside it, then renamed, so that replicas starting together on one
    node never load a half-written file."""
    folder, out = Path(folder), Path(out)
    config = json.loads((folder / "config.json").read_text())
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    partial = out.with_name(f"{out.name}.{os.getpid()}.partial")
    write_gguf(config, weights, _folder_vocabulary(folder, config["vocab_size"]), partial, quant, folder.name)
    os.replace(partial, out)
    return out


def write_if_missing(spec) -> bool:
    """Write spec.path (a cluster.config.ModelSpec naming a GGUF file) from its tokenizer
    folder, in the type its name says, when the file is missing and the folder holds the
    weights; whether it wrote. Run where the file is read: by `specserve up` before it deploys,
    and by each replica on its own node (a KubeRay pod or a `ray job submit` worker has the
    folder in its image but no file written by a start on another machine)."""
    if not spec.is_gguf or spec.path.is_file() or not spec.gguf_buildable:
        return False
    spec.path.parent.mkdir(parents=True, exist_ok=True)
    export(spec.tokenizer, spec.path, spec.gguf_type)
    return True


def export_model(model, vocabulary: list[str], out: Path, quant: str = "f32") -> Path:
    """Write an in-memory transformers Llama whose token i is vocabulary[i]: a vocabulary
    that only names ids, for models the tests never tokenize from text. llama.cpp refuses a
    BPE vocabulary without merges, so it gets one, of its first two tokens."""
    vocabulary = Vocabulary(list(vocabulary), [gguf.TokenType.NORMAL] * len(vocabulary),
                            [f"{vocabulary[0]} {vocabulary[1]}"])
    return write_gguf(model.config.to_dict(), model.state_dict(), vocabulary, out, quant, "model")


def folder_vocabulary(folder: Path) -> Vocabulary:
    """The vocabulary export() writes for a Hugging Face folder."""
    return _folder_vocabulary(Path(folder), json.loads((Path(folder) / "config.json").read_text())["vocab_size"])


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]          # by id
    types: list[int]           # gguf.TokenType by id
    merges: list[str]          # byte-level BPE merges, "a b" each


def write_gguf(config: dict, weights: dict[str, torch.Tensor], vocabulary: Vocabulary, out: Path,
               quant: str = "f32", name: str = "model") -> Path:
    """A GGUF file of a Llama from its config.json mapping and its transformers weights."""
    if config.get("model_type") != "llama":
        raise ValueError(f"model_type {config.get('model_type')!r}; only llama is exported")
    qtype, file_type = QUANT_TYPES[quant]
    writer = gguf.GGUFWriter(str(out), "llama")
    _write_hyperparameters(writer, config, name, file_type)
    _write_tokenizer(writer, vocabulary, config)
    for tensor_name, tensor in _tensors(weights, config):
        _add_tensor(writer, tensor_name, tensor, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_hyperparameters(writer: gguf.GGUFWriter, config: dict, name: str, file_type) -> None:
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or config.get("rope_scaling"):
        raise ValueError("only the default RoPE (no scaling) is exported")
    writer.add_name(name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)


def _folder_vocabulary(folder: Path, vocab_size: int) -> Vocabulary:
    """The byte-level BPE vocabulary and merges of the folder's tokenizer.json, by id."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    model = tokenizer["model"]
    if model["type"] != "BPE":
        raise ValueError(f"{folder}/tokenizer.json: a {model['type']} tokenizer; only byte-level BPE is exported")
    by_id = {index: text for text, index in model["vocab"].items()}
    special = set()
    for added in tokenizer.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        if added.get("special"):
            special.add(added["id"])
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [gguf.TokenType.CONTROL if i in special else
             gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return Vocabulary(tokens, types, merges)


def _write_tokenizer(writer: gguf.GGUFWriter, vocabulary: Vocabulary, config: dict) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.types)
    writer.add_token_merges(vocabulary.merges)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id)):
        value = config.get(key)
        if value is not None:
            add(value[0] if isinstance(value, list) else value)


def _tensors(weights: dict[str, torch.Tensor], config: dict):
    """(GGUF name, float32 tensor) of every weight, q and k rows reordered for llama.cpp's RoPE."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    for hf_name, tensor in weights.items():
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue                 # llama.cpp reads the embedding where output.weight is absent
        tensor = tensor.detach().float()
        if hf_name.endswith("self_attn.q_proj.weight"):
            tensor = interleaved_rope_rows(tensor, heads)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            tensor = interleaved_rope_rows(tensor, kv_heads)
        yield gguf_name(hf_name), tensor


def _add_tensor(writer: gguf.GGUFWriter, name: str, tensor: torch.Tensor, qtype) -> None:
    """Matrices in the chosen type; norms (1-D) stay float32, as llama.cpp requires."""
    data = tensor.numpy().astype(np.float32)
    if data.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, data)
        return
    if qtype == gguf.GGMLQuantizationType.Q8_0 and data.shape[-1] % 32:
        writer.add_tensor(name, data.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F16)
        return
    writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)   # bytes: shape from the type


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a Hugging Face Llama folder (config.json, safetensors, tokenizer.json)")
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    parser.add_argument("--type", choices=sorted(QUANT_TYPES), default="f32", help="the matrices' type")
    args = parser.parse_args()
    print(export(args.folder, args.out, args.type))


if __name__ == "__main__":
    main()
