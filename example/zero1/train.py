"""GPT-2 training with the zero1 strategy, through the shared loop in ``example/trainer.py``.

torchrun --standalone --nproc_per_node=2 example/zero1/train.py --model gpt2_bytes --lr 1e-3
torchrun --standalone --nproc_per_node=2 example/zero1/train.py --model gpt2_medium --steps 200
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from example.trainer import main  # noqa: E402

if __name__ == "__main__":
    main("zero1")
