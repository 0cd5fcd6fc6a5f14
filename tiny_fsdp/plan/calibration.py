"""The machine as the planner sees it: compute rates and collective costs, as editable JSON data.

[Note: calibration]
A calibration is a JSON file; every number carries its ``source`` (a measurement on this machine,
a datasheet, a paper). Fields:

- ``backend``: ``"nccl"`` or ``"gloo"``: ZeRO-1/2 on gloo replace their all-gather by one
  broadcast per rank and, on more than 2 ranks, their reduce-scatter by an all-reduce ([Note:
  ZeRO collectives on gloo]).
- ``compute.flops_per_s``: the matrix-product rate of one rank *while every rank computes* (on a
  shared CPU that is the honest rate), at ``compute.shape`` = ``(rows, in, out)``: ``--calibrate``
  takes the shape of the model it is given (``ModelCosts.calibration_shape``), because the rates
  depend on it: on the 2-core development machine, elementwise work on a (1024, 512) tensor
  cost 0.9e-9 s/byte and on a (2048, 4096) one 2.4e-9 (fresh pages for each large
  allocation), and matrix products ran at 47-62 against 66-79 GFLOP/s.
- ``compute.optimizer_s_per_param``: one optimizer step (tiny_fsdp AdamW), seconds per element,
  and ``compute.optimizer_s_per_tensor`` its fixed cost per tensor (AdamW updates tensor by
  tensor: a dozen small operations each on CUDA, on the CPU a share of one fused call; a model
  of many small tensors feels it).
- ``compute.activation_s_per_byte``: elementwise work (norms, GELU, softmax: memory-bound)
  forward and backward, seconds per byte of activations kept for backward.
- ``compute.layer_overhead_s``: fixed cost of running one layer forward and backward (kernel
  launches, Python, autograd), which FLOPs do not see; it dominates small models.
- ``compute.wrapper_layer_s[strategy]`` and ``compute.wrapper_unit_s[strategy]`` (ZeRO-3,
  FSDP): what each wrapper adds per layer and per unit (ZeRO-3: per owner of a unit's tensors)
  beyond its collectives, fitted so that the planner's schedule of a probe model reproduces
  what the wrapper adds to the probe's step ([Note: wrapper costs]).
- ``collectives[kind][world_size] = {"alpha_s", "beta_s_per_byte"}``: the time of one collective
  of ``P`` payload bytes ([Note: communication ledger]) is ``alpha + beta * P`` (Hockney's
  alpha-beta model), fitted to measurements at a few sizes.
- ``link.comm_channels``: collectives of one process group that run at once (gloo: its 2
  worker threads by default; NCCL: 1, one stream).
- ``link``: for world sizes not measured, a ring over links of ``latency_s`` and
  ``bandwidth_bytes_per_s`` (the NIC's ``inter_node_bandwidth_bytes_per_s`` once a ring spans
  more than ``ranks_per_node`` ranks: the slowest link sets a ring's pace): a collective
  takes ``steps * latency + volume / bandwidth`` with the ring's steps and volume ([Note:
  collective costs]).

Presets (``presets/*.json``) describe common hardware from datasheets; ``--calibrate`` writes one
measured here. Edit either: the planner reads nothing else about the machine.
"""

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

PRESET_DIR = os.path.join(os.path.dirname(__file__), "presets")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


@dataclass
class Calibration:
    """A parsed calibration file ([Note: calibration]); ``sources`` says where numbers come from."""

    name: str
    backend: str
    flops_per_s: float
    optimizer_s_per_param: float
    layer_overhead_s: float
    activation_s_per_byte: float
    latency_s: float
    bandwidth_bytes_per_s: float
    inter_node_bandwidth_bytes_per_s: Optional[float] = None
    ranks_per_node: Optional[int] = None
    wrapper_layer_s: Dict[str, float] = field(default_factory=dict)
    wrapper_unit_s: Dict[str, float] = field(default_factory=dict)  # ZeRO-3 / FSDP, per unit
    overlap: float = 1.0
    optimizer_s_per_tensor: float = 0.0
    comm_channels: int = 1
    collectives: Dict[str, Dict[int, Dict[str, float]]] = field(default_factory=dict)
    sources: Dict[str, str] = field(default_factory=dict)
    shape: Optional[Tuple[int, int, int]] = None  # (rows, in, out) measured at; None: a preset

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Calibration":
        compute, link = data["compute"], data["link"]
        collectives = {
            kind: {int(n): dict(fit) for n, fit in per_world.items()}
            for kind, per_world in data.get("collectives", {}).items()
        }
        unknown = sorted(set(collectives) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown collective kinds {unknown} in calibration; use {KINDS}")
        return cls(
            name=data.get("name", "unnamed"),
            backend=data.get("backend", "nccl"),
            flops_per_s=float(compute["flops_per_s"]),
            optimizer_s_per_param=float(compute.get("optimizer_s_per_param", 0.0)),
            layer_overhead_s=float(compute.get("layer_overhead_s", 0.0)),
            activation_s_per_byte=float(compute.get("activation_s_per_byte", 0.0)),
            latency_s=float(link["latency_s"]),
            bandwidth_bytes_per_s=float(link["bandwidth_bytes_per_s"]),
            inter_node_bandwidth_bytes_per_s=link.get("inter_node_bandwidth_bytes_per_s"),
            ranks_per_node=link.get("ranks_per_node"),
            comm_channels=int(link.get("comm_channels", 2 if data.get("backend") == "gloo" else 1)),
            wrapper_layer_s={k: float(v) for k, v in compute.get("wrapper_layer_s", {}).items()},
            wrapper_unit_s={k: float(v) for k, v in compute.get("wrapper_unit_s", {}).items()},
            overlap=float(compute.get("overlap", 1.0)),
            optimizer_s_per_tensor=float(compute.get("optimizer_s_per_tensor", 0.0)),
            collectives=collectives,
            sources=dict(data.get("sources", {})),
            shape=tuple(compute["shape"]) if compute.get("shape") else None,
        )

    def to_dict(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "backend": self.backend,
            "compute": {
                "flops_per_s": self.flops_per_s,
                "optimizer_s_per_param": self.optimizer_s_per_param,
                "optimizer_s_per_tensor": self.optimizer_s_per_tensor,
                "layer_overhead_s": self.layer_overhead_s,
                "activation_s_per_byte": self.activation_s_per_byte,
                "wrapper_layer_s": self.wrapper_layer_s,
                "wrapper_unit_s": self.wrapper_unit_s,
                "overlap": self.overlap,
                "shape": list(self.shape) if self.shape else None,
            },
            "link": {
                "latency_s": self.latency_s,
                "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
                "inter_node_bandwidth_bytes_per_s": self.inter_node_bandwidth_bytes_per_s,
                "ranks_per_node": self.ranks_per_node,
                "comm_channels": self.comm_channels,
            },
            "collectives": {
                kind: {str(n): fit for n, fit in sorted(per_world.items())}
                for kind, per_world in self.collectives.items()
            },
            "sources": self.sources,
        }


def preset_names() -> List[str]:
    return sorted(f[: -len(".json")] for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


def load_calibration(name_or_path: str) -> Calibration:
    """A preset's name (``preset_names()``) or the path of a calibration JSON file."""
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(PRESET_DIR, f"{name_or_path}.json")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"no calibration file {name_or_path!r} and no preset of that name; presets: "
            f"{preset_names()}, or write one with python -m tiny_fsdp.plan --calibrate FILE"
        )
    with open(path) as f:
        return Calibration.from_dict(json.load(f))


def save_calibration(calibration: Calibration, path: str) -> None:
    with open(path, "w") as f:
        json.dump(calibration.to_dict(), f, indent=2)
        f.write("\n")
