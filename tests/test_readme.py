"""The README's "Using it" code, run as written on 2 gloo ranks, trains like torch DDP + AdamW.

Only the model size changes (``GPTConfigs.gpt2`` -> ``gpt2_tiny``). Each paragraph that builds a
``model`` and an ``optimizer`` is one case of ``check_parity`` (same seed as the reference, whose
``torch.optim.AdamW`` has the README's ``lr`` and torch's default weight decay, as ours).
"""

import re
from pathlib import Path
from typing import Any, Dict, List, Tuple

import torch

from tests.harness import run_distributed
from tests.parity import check_parity

README = Path(__file__).resolve().parents[1] / "README.md"
GPT2 = re.compile(r"GPTConfigs\.gpt2$", re.MULTILINE)


def _using_it() -> Tuple[str, List[str]]:
    """The "Using it" block as (imports and ``config``, the paragraphs that wrap a model)."""
    section = README.read_text().split("## Using it", 1)[1]
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None, "README: no python block under 'Using it'"
    code = GPT2.sub("GPTConfigs.gpt2_tiny", block.group(1))
    config = re.search(r"^config = .*$", code, re.MULTILINE)
    assert config is not None, "README: 'Using it' sets no config"
    imports, *paragraphs = code.split("\n\n")
    wrapping = [p for p in paragraphs if "model = " in p and "optimizer = " in p]
    return imports + "\n" + config.group(0), wrapping


def _paragraph_trains(rank: int, world_size: int, setup: str, paragraph: str) -> str:
    built = []

    def wrap(_reference_copy: torch.nn.Module) -> Any:
        namespace: Dict[str, Any] = {}
        exec(setup, namespace)
        torch.manual_seed(0)  # check_parity's reference: make_model(seed=0)
        exec(paragraph, namespace)
        built.append(type(namespace["model"]).__name__)
        return namespace["model"], namespace["optimizer"]

    def reference_optimizer(reference: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(reference.parameters(), lr=1e-4)

    check_parity(rank, world_size, wrap, reference_optimizer, lambda m: m.state_dict(), steps=3)
    return built[0]


def test_every_way_to_wrap_in_the_readme_trains_like_torch_ddp() -> None:
    setup, wrapping = _using_it()
    wrapped = []
    for paragraph in wrapping:
        wrapped += run_distributed(_paragraph_trains, 2, setup, paragraph)[:1]
    assert wrapped == ["DDP", "FSDP", "Zero3", "Zero3"]
