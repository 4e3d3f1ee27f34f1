"""The README's Python examples run as written: its API overview imports, and the planning
examples (a global batch cut for a 7B GPT, then planned into per-rank plans) return what the text
says. The executor and loader examples need a process group and a torchrun job; their imports are
checked and their code compiled."""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)


def _block(marker: str) -> str:
    found = [b for b in _python_blocks() if marker in b]
    assert len(found) == 1, f"one README Python example holds {marker!r}, found {len(found)}"
    return found[0]


def test_every_example_compiles_and_its_imports_resolve():
    blocks = _python_blocks()
    assert len(blocks) >= 5
    for block in blocks:
        tree = ast.parse(block)  # a syntax error in the README fails here
        imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        exec(compile(ast.Module(body=imports, type_ignores=[]), "README.md", "exec"), {})


def test_the_planning_examples_run_and_return_what_the_text_names():
    ns: dict = {}
    exec(_block("plan = plan_micro_batches("), ns)
    plan = ns["plan"]
    assert plan.objective_ms > 0 and 0 < plan.padding_efficiency <= 1
    assert sum(len(mb.samples) for mb in plan.micro_batches) == 256  # every sample, once
    exec(_block("it = plan_iteration("), ns)
    it = ns["it"]
    assert it.simulated_ms > 0 and len(it.stage_peak_mib) == 8
    assert it.plan_for(1, 7) is not None
    from dynapipe.errors import DynaPipeError

    with pytest.raises(DynaPipeError):
        it.plan_for(2, 0)  # outside the layout: dp 2
