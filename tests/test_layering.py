"""The planning layers stay pure Python + numpy: importing them, or running the planning commands,
loads no torch and no megatron-core, so a planner node or a laptop needs neither."""
import subprocess
import sys

import pytest

PLANNING = ("dynapipe.batching", "dynapipe.cost", "dynapipe.schedule", "dynapipe.plan", "dynapipe.data",
            "dynapipe.pipeline_planner", "dynapipe.iteration_plan", "dynapipe.advise", "dynapipe.config",
            "dynapipe.method_compare", "dynapipe.topology", "dynapipe.cli")
HEAVY = ("torch", "megatron", "megatron_integration")

PROBE = """
import importlib, pkgutil, sys
names = sys.argv[1].split(",")
for name in names:
    mod = importlib.import_module(name)
    for info in pkgutil.iter_modules(getattr(mod, "__path__", [])):
        importlib.import_module(name + "." + info.name)
heavy = set(sys.argv[2].split(","))
print(",".join(sorted({key.split(".")[0] for key in sys.modules} & heavy)))
"""


def _heavy_modules_loaded(code: str, *args: str) -> str:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""


def test_importing_every_planning_module_loads_no_torch_or_megatron():
    assert _heavy_modules_loaded(PROBE, ",".join(PLANNING), ",".join(HEAVY)) == ""


@pytest.mark.parametrize("argv", [["synth", "--samples", "16", "--seed", "0"],
                                  ["cost", "--model", "gpt-tiny", "--device", "cpu", "--stages", "2",
                                   "--shape", "1,128"],
                                  ["plan", "--model", "gpt-tiny", "--device", "cpu", "--stages", "2",
                                   "--lengths", "LENGTHS"]])
def test_a_planning_command_loads_no_torch_or_megatron(argv, tmp_path):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("".join(f"{n}\n" for n in range(40, 200, 10)))
    argv = [str(lengths) if a == "LENGTHS" else a for a in argv]
    code = ("import sys, runpy, io, contextlib\n"
            "sys.argv = ['dynapipe'] + sys.argv[1:]\n"
            "buf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf):\n"
            "    try:\n"
            "        runpy.run_module('dynapipe', run_name='__main__')\n"
            "    except SystemExit as e:\n"
            "        assert not e.code, buf.getvalue()\n"
            "print(','.join(sorted({k.split('.')[0] for k in sys.modules} & {'torch', 'megatron', "
            "'megatron_integration'})))\n")
    assert _heavy_modules_loaded(code, *argv) == ""


def test_only_the_command_line_imports_the_command_line():
    # The command line calls the layers below it, never the other way round: a lower layer
    # importing dynapipe.cli would tie a Python caller (a training script, the bench) to the
    # command line's parsing and its spelling of errors.
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    offenders = []
    for path in [*root.glob("dynapipe/**/*.py"), *root.glob("megatron_integration/**/*.py")]:
        rel = path.relative_to(root).as_posix()
        if rel.startswith("dynapipe/cli/") or rel == "dynapipe/__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "dynapipe.cli" or n.startswith("dynapipe.cli.") for n in names):
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, offenders
