"""Single-device GPT-2 training: the reference every strategy must match.

python example/single_device/train.py --model gpt2 --lr 1e-4 --steps 100
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from example.trainer import main  # noqa: E402

if __name__ == "__main__":
    main("single_device")
