"""The planner: predicted peak memory and step time of every strategy at any scale.

    python -m tiny_fsdp.plan --model gpt2_xl --world_size 64 --gpu_memory 80GiB --batch_size 8 \\
        --seq_len 1024 --precision bf16 [--grad_ckpt] [--calibration FILE] [--json]

See [Note: what the planner predicts] (``planner.py``), [Note: model costs], [Note: attention on
meta] (``meta_forward.py``), [Note: strategy schedules], [Note: collective costs] and [Note:
calibration].
"""

from tiny_fsdp.plan.calibration import Calibration, load_calibration, save_calibration
from tiny_fsdp.plan.model_costs import ModelCosts, gpt2_costs, module_costs
from tiny_fsdp.plan.planner import STRATEGIES, Prediction, plan, plan_model

__all__ = [
    "Calibration",
    "ModelCosts",
    "Prediction",
    "STRATEGIES",
    "gpt2_costs",
    "load_calibration",
    "module_costs",
    "plan",
    "plan_model",
    "save_calibration",
]
