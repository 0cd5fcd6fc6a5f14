"""GPT-2 weights saved in HuggingFace's format, loaded into ``GPT2Model``.

``load_hf_gpt2(directory)`` reads what ``GPT2LMHeadModel.save_pretrained(directory)`` writes:
``config.json`` and the weights as ``model.safetensors`` (one file or shards listed in
``model.safetensors.index.json``) or ``pytorch_model.bin``. Neither ``transformers`` nor
``safetensors`` is needed: the safetensors layout is a little-endian u64 header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}`` and the raw bytes.

HuggingFace's GPT-2 stores its attention and MLP projections as ``Conv1D`` with weight (in, out);
``GPT2Model`` uses ``nn.Linear`` with weight (out, in), so those four matrices are transposed.
The vocabulary is taken as saved (50257 for OpenAI's checkpoints, not padded to 50304), so the
logits are those of the saved model.
"""

import json
import os
import struct
from typing import Dict

import torch

from tiny_fsdp.models.gpt2 import GPT2Model, GPTConfig

_CONV1D_WEIGHTS = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_safetensors(path: str) -> Dict[str, torch.Tensor]:
    """All tensors of one ``.safetensors`` file, on the CPU."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor '{name}' has unsupported dtype {info['dtype']}")
        begin, end = info["data_offsets"]
        flat = torch.frombuffer(
            bytearray(data[begin:end]), dtype=_SAFETENSORS_DTYPES[info["dtype"]]
        )
        tensors[name] = flat.reshape(info["shape"])
    return tensors


def read_hf_state_dict(directory: str) -> Dict[str, torch.Tensor]:
    """The saved weights under HuggingFace's names, whichever of its file layouts is present."""
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    binary = os.path.join(directory, "pytorch_model.bin")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        state: Dict[str, torch.Tensor] = {}
        for name in files:
            state.update(read_safetensors(os.path.join(directory, name)))
        return state
    if os.path.exists(single):
        return read_safetensors(single)
    if os.path.exists(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise FileNotFoundError(
        f"{directory}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin; "
        "point --init_from at the directory that save_pretrained() wrote"
    )


def hf_gpt2_config(directory: str) -> GPTConfig:
    """``GPTConfig`` of the GPT-2 saved in ``directory`` (its ``config.json``)."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{directory}: no config.json; point --init_from at the directory that "
            "save_pretrained() wrote"
        )
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{directory} holds a '{cfg['model_type']}' model, not GPT-2")
    if cfg.get("n_inner") not in (None, 4 * cfg["n_embd"]):
        raise ValueError(f"{directory}: n_inner={cfg['n_inner']} (GPT2Model uses 4 * n_embd)")
    if cfg.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"{directory}: activation {cfg['activation_function']} is not GPT-2's")
    return GPTConfig(
        block_size=cfg["n_positions"],
        vocab_size=cfg["vocab_size"],
        n_layer=cfg["n_layer"],
        n_head=cfg["n_head"],
        n_embd=cfg["n_embd"],
        bias=True,
        dropout=float(cfg.get("resid_pdrop", 0.0)),
    )


def hf_gpt2_to_ours(hf_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """HuggingFace GPT-2 tensors -> ``GPT2Model.state_dict()`` keys (fp32, Conv1D transposed).

    Attention-mask buffers of older saves (``attn.bias``, ``attn.masked_bias``) are dropped; a
    missing ``lm_head.weight`` is fine (it is ``wte.weight``).
    """
    ours = {}
    for name, tensor in hf_state.items():
        key = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
        if key.endswith((".attn.bias", ".attn.masked_bias")):  # causal-mask buffers
            continue
        tensor = tensor.to(torch.float32)
        if key.endswith(_CONV1D_WEIGHTS):
            tensor = tensor.t()
        ours[key] = tensor.contiguous()
    ours.setdefault("lm_head.weight", ours["transformer.wte.weight"])
    return ours


def load_hf_gpt2(directory: str) -> GPT2Model:
    """``GPT2Model`` with the config and weights that ``save_pretrained`` wrote to ``directory``."""
    model = GPT2Model(hf_gpt2_config(directory))
    model.load_state_dict(hf_gpt2_to_ours(read_hf_state_dict(directory)))
    return model
