"""The Hugging Face Llama folder: what `python -m pretrain.export` writes and `model.init_from` reads.

    DIR/config.json                    LlamaConfig's fields (FIELDS: ours -> theirs)
    DIR/model.safetensors              the weights; above the shard size, model-0000K-of-0000N.safetensors
    DIR/model.safetensors.index.json   with this index of which tensor is in which file
    DIR/generation_config.json, tokenizer.json, tokenizer_config.json

Our parameter names differ from Hugging Face's (hf_name), and so does the order of the rows of the
query and key projections: our RoPE rotates adjacent channel pairs, theirs the two halves of each head
(pretrain.hf.layout permutes those rows). No torch here: the launcher checks a model.init_from source
against the run's model before anything starts, from config.json and the safetensors headers (8 bytes
of length, then JSON with every tensor's dtype and shape), without reading a weight.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.config import ConfigError, ModelConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# The output dtypes of an export, by their names on our command line.
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}

# Our ModelConfig fields and their LlamaConfig keys, in the order a mismatch is reported.
FIELDS = {"vocab_size": "vocab_size", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
          "dim": "hidden_size", "n_layers": "num_hidden_layers", "ffn_hidden": "intermediate_size",
          "tie_embeddings": "tie_word_embeddings", "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
          "max_seq_len": "max_position_embeddings"}
# Fields that must agree between an init_from source and the run: all but the context length, which
# is the run's choice (RoPE has no learned positions).
MATCHED = tuple(name for name in FIELDS if name != "max_seq_len")

TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
BLOCK_NAMES = {"attention_norm.weight": "input_layernorm.weight", "attention.wq.weight": "self_attn.q_proj.weight",
               "attention.wk.weight": "self_attn.k_proj.weight", "attention.wv.weight": "self_attn.v_proj.weight",
               "attention.wo.weight": "self_attn.o_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               "feed_forward.w1.weight": "mlp.gate_proj.weight", "feed_forward.w2.weight": "mlp.down_proj.weight",
               "feed_forward.w3.weight": "mlp.up_proj.weight"}
# The projections whose rows RoPE rotates: permuted between our layout and Hugging Face's.
ROTATED = ("attention.wq.weight", "attention.wk.weight")


def hf_name(name: str) -> str:
    """Hugging Face's name of one of our parameters: layers.3.attention.wq.weight -> model.layers.3.self_attn.q_proj.weight."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    _, index, part = name.split(".", 2)
    return f"model.layers.{index}.{BLOCK_NAMES[part]}"


def is_rotated(name: str) -> bool:
    return name.endswith(ROTATED)


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameters (the names of the model's state dict) and their shapes; with tied embeddings the
    output layer is the embedding and is left out, as Hugging Face leaves out lm_head."""
    head_dim = cfg.dim // cfg.n_heads
    block = {"attention_norm.weight": (cfg.dim,), "attention.wq.weight": (cfg.n_heads * head_dim, cfg.dim),
             "attention.wk.weight": (cfg.kv_heads * head_dim, cfg.dim),
             "attention.wv.weight": (cfg.kv_heads * head_dim, cfg.dim),
             "attention.wo.weight": (cfg.dim, cfg.n_heads * head_dim), "ffn_norm.weight": (cfg.dim,),
             "feed_forward.w1.weight": (cfg.ffn_hidden, cfg.dim), "feed_forward.w2.weight": (cfg.dim, cfg.ffn_hidden),
             "feed_forward.w3.weight": (cfg.ffn_hidden, cfg.dim)}
    shapes = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim)}
    for index in range(cfg.n_layers):
        shapes.update({f"layers.{index}.{part}": shape for part, shape in block.items()})
    shapes["norm.weight"] = (cfg.dim,)
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, cfg.dim)
    return shapes


# ---- config.json ------------------------------------------------------------------------------
def config_json(cfg: ModelConfig, dtype: str, eos_id: int | None) -> dict[str, Any]:
    """A LlamaConfig of the model, in the keys every transformers version reads (rope_theta, torch_dtype)."""
    values = {**{key: getattr(cfg, name) for name, key in FIELDS.items()}, "num_key_value_heads": cfg.kv_heads}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **values, "head_dim": cfg.dim // cfg.n_heads,
            "hidden_act": "silu", "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
            "mlp_bias": False, "initializer_range": cfg.init_std, "torch_dtype": dtype, "bos_token_id": None,
            "eos_token_id": eos_id, "use_cache": True}


def read_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: cannot read it ({error}); a Hugging Face model folder has a JSON config.json") \
            from None


def model_fields(hf: dict[str, Any], source: Path) -> dict[str, Any]:
    """Our ModelConfig fields from a Llama config.json; ConfigError for what this model cannot be."""
    def unsupported(what: str) -> ConfigError:
        return ConfigError(f"{source}/{CONFIG_FILE}: {what}, which this package's Llama does not have; "
                           "model.init_from takes Llama models with SwiGLU, no biases and plain RoPE")

    if hf.get("model_type") != "llama":
        raise unsupported(f"model_type {hf.get('model_type')!r} is not 'llama'")
    if hf.get("hidden_act", "silu") != "silu":
        raise unsupported(f"hidden_act {hf['hidden_act']!r}")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise unsupported("biases in the attention or MLP layers")
    rope = hf.get("rope_parameters") or {}  # transformers 5; 4.x writes rope_theta and rope_scaling
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise unsupported(f"RoPE scaling {rope_type!r}")
    try:
        fields = {name: hf[key] for name, key in FIELDS.items()
                  if key not in ("num_key_value_heads", "tie_word_embeddings", "rope_theta")}
    except KeyError as missing:
        raise ConfigError(f"{source}/{CONFIG_FILE} has no {missing.args[0]}: not a Llama config") from None
    # LlamaConfig's defaults for the keys older config.json files leave out.
    fields.update(n_kv_heads=hf.get("num_key_value_heads") or fields["n_heads"],
                  tie_embeddings=hf.get("tie_word_embeddings", False),
                  rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))))
    head_dim = hf.get("head_dim") or fields["dim"] // fields["n_heads"]
    if head_dim * fields["n_heads"] != fields["dim"]:
        raise unsupported(f"head_dim {head_dim} x {fields['n_heads']} heads != hidden_size {fields['dim']}")
    return fields


# ---- safetensors files ------------------------------------------------------------------------
@dataclass(frozen=True)
class StoredTensor:
    """A tensor in a safetensors file, known from the file's header."""

    file: Path
    dtype: str  # safetensors' name: BF16, F32, ...
    shape: tuple[int, ...]


def weight_files(source: Path) -> list[Path]:
    """The safetensors files of a model.init_from source: the file itself, the shards a folder's index
    lists, its model.safetensors, or else every *.safetensors file in it."""
    source = Path(source)
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise ConfigError(f"model.init_from={source}: no such file or folder")
    if (source / INDEX_FILE).is_file():
        weight_map = json.loads((source / INDEX_FILE).read_text())["weight_map"]
        return [source / name for name in sorted(set(weight_map.values()))]
    if (source / WEIGHTS_FILE).is_file():
        return [source / WEIGHTS_FILE]
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.init_from={source}: no *.safetensors files there; give a Hugging Face Llama "
                          f"folder (config.json and {WEIGHTS_FILE} or {INDEX_FILE}) or a .safetensors file")
    return files


def read_header(path: Path) -> dict[str, StoredTensor]:
    """Every tensor of one safetensors file, from its header."""
    try:
        with Path(path).open("rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        return {name: StoredTensor(Path(path), info["dtype"], tuple(info["shape"]))
                for name, info in header.items() if name != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ConfigError(f"{path}: not a readable safetensors file ({error})") from None


def stored_tensors(source: Path) -> dict[str, StoredTensor]:
    """Every tensor of a model.init_from source, by name."""
    found: dict[str, StoredTensor] = {}
    for file in weight_files(source):
        if not file.is_file():
            raise ConfigError(f"model.init_from={source}: {file.name}, listed in {INDEX_FILE}, is missing")
        found.update(read_header(file))
    return found


# ---- checking a source against a model --------------------------------------------------------
def check_config(cfg: ModelConfig, source: Path) -> None:
    """Raise ConfigError naming the first field where source/config.json differs from the model, and
    the overrides that would match all of them."""
    theirs = model_fields(read_config(source), source)
    ours = {name: cfg.kv_heads if name == "n_kv_heads" else getattr(cfg, name) for name in MATCHED}
    differing = [name for name in MATCHED if theirs[name] != ours[name]]
    if differing:
        first = differing[0]
        overrides = " ".join(f"model.{name}={theirs[name]}" for name in differing)
        raise ConfigError(f"model.init_from={source}: its {CONFIG_FILE} has {FIELDS[first]}={theirs[first]}, but "
                          f"model.{first}={ours[first]} here; to start from it set {overrides}")


def check_source(cfg: ModelConfig, source: Path) -> dict[str, StoredTensor]:
    """Raise ConfigError naming the first config field or tensor where model.init_from differs from the
    model; returns each of our parameters' tensor in the source."""
    source = Path(source)
    configured = source.is_dir() and (source / CONFIG_FILE).is_file()
    if configured:
        check_config(cfg, source)
    stored = stored_tensors(source)
    found = {}
    for name, shape in parameter_shapes(cfg).items():
        tensor = stored.get(hf_name(name))
        if tensor is None:
            raise ConfigError(f"model.init_from={source}: no tensor {hf_name(name)} (the model's {name}, shape "
                              f"{list(shape)}); is it a Llama of this shape?")
        if tensor.shape != shape:
            raise ConfigError(f"model.init_from={source}: {hf_name(name)} has shape {list(tensor.shape)}, but the "
                              f"model's {name} has {list(shape)}; set the model's sizes to those of the source")
        found[name] = tensor
    taken = {hf_name(name) for name in found}
    if cfg.tie_embeddings and configured:  # a tied model (config.json says so) saved with its lm_head all the same
        taken.add(TOP_NAMES["output.weight"])
    extra = sorted(name for name in stored if name not in taken and not name.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ConfigError(f"model.init_from={source}: {extra[0]} is not a tensor of this model"
                          f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; is it a Llama of this shape?")
    return found
