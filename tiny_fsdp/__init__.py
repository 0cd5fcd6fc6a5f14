"""tiny_fsdp: data-parallel training strategies (DDP, ZeRO-1/2/3, FSDP) side by side."""

__version__ = "0.1.0"
