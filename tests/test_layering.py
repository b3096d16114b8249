"""The package's layering, enforced: every top-level unit of ``slipstream/`` sits on a floor and
may import only units on lower floors (also inside functions and under ``TYPE_CHECKING``), no
module takes part in an import cycle, and only the comm layer touches ``torch.distributed``.

docs/architecture.md explains the floors. A new top-level module or package must be added to
``FLOORS`` here, on the floor its imports allow.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "slipstream"

# Lowest first. A unit imports only units of strictly lower floors.
FLOORS: list[set[str]] = [
    {"version", "_logging"},
    {"config", "accelerator"},
    {"distributed"},
    {"precision", "optim", "data", "profiling"},
    {"parallel", "sequence", "moe"},
    {"zero"},
    {"models", "checkpoint"},
    {"runtime"},
    {"quant", "vision", "diffusion", "recsys", "science"},
    {"compression"},  # DeepSpeed's compression library: quantization-aware training on quant
    {"inference", "planner"},  # inference runs quantized models; the planner reads quant too
    {"rlhf", "multimodal"},  # RLHF generates with the inference engine and trains with runtime
    # DeepSpeed's import paths, each a thin re-export of the units above.
    {"comm", "pipe", "checkpointing", "utils", "ops", "monitor"},
    {"git_version_info"},  # DeepSpeed's install-time facts, read from the units above
    {""},  # slipstream/__init__.py, the public facade
    {"cli"},
    {"launcher"},  # deepspeed.launcher.runner: the `deepspeed` command on `slipstream run`
    {"constants"},  # deepspeed.constants: the launcher's port and variable names
]
FLOOR_OF = {unit: i for i, floor in enumerate(FLOORS) for unit in floor}

# Modules outside slipstream/distributed that may import torch.distributed, and why.
TORCH_DISTRIBUTED_ALLOWED = {
    # Reads the rank for log prefixes; it sits below the comm layer, which logs through it.
    "_logging.py",
    # Launching processes (torchrun's elastic agent), not collectives.
    "cli/launcher.py",
    "cli/_failures.py",
    # Reports which backends the installed torch.distributed build has.
    "cli/report.py",
}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _module_name(path: Path) -> str:
    parts = ["slipstream", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(module: str) -> bool:
    rel = Path(*module.split(".")[1:])
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


@cache
def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every slipstream module that ``path`` imports."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # ``from slipstream.x import y`` imports slipstream.x.y when y is a module.
            subs = [f"{module}.{a.name}" for a in node.names if _exists(f"{module}.{a.name}")]
            found += [(node.lineno, m) for m in subs] or [(node.lineno, module)]
    return [(line, m) for line, m in found if m == "slipstream" or m.startswith("slipstream.")]


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_unit_has_a_floor() -> None:
    units = {_unit(_module_name(p)) for p in _modules()}
    missing = sorted(units - FLOOR_OF.keys())
    assert not missing, f"top-level units without a floor in tests/test_layering.py: {missing}"


def test_imports_go_down_the_floors() -> None:
    wrong = []
    for path in _modules():
        unit = _unit(_module_name(path))
        for line, module in _imports(path):
            target = _unit(module)
            if target != unit and FLOOR_OF.get(target, -1) >= FLOOR_OF.get(unit, -1):
                wrong.append(
                    f"{path.relative_to(PACKAGE.parent)}:{line} imports {module} "
                    f"({target or 'slipstream'} is on floor {FLOOR_OF.get(target)}, "
                    f"{unit or 'slipstream'} on {FLOOR_OF.get(unit)})"
                )
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_import_cycles() -> None:
    graph = {_module_name(p): {m for _, m in _imports(p)} for p in _modules()}
    # A package's __init__ re-exporting its own modules is not a cycle of the design: those
    # modules import siblings directly, never their package.
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not module.startswith(t + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def _touches_torch_distributed(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(
            a.name.startswith("torch.distributed") for a in node.names
        ):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            names = {a.name for a in node.names}
            if (node.module or "").startswith("torch.distributed") or "distributed" in names:
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            lines.append(node.lineno)
    return lines


def test_torch_distributed_only_in_the_comm_layer() -> None:
    wrong = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("distributed/") or rel in TORCH_DISTRIBUTED_ALLOWED:
            continue
        wrong += [
            f"slipstream/{rel}:{line}"
            for line in _touches_torch_distributed(ast.parse(path.read_text()))
        ]
    assert not wrong, "torch.distributed outside slipstream/distributed (use comm):\n" + "\n".join(
        wrong
    )


def _creates_groups(tree: ast.AST) -> list[int]:
    """Lines that call ``new_group`` (``comm.new_group``, ``dist.new_group``, bare)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and (
            (isinstance(node.func, ast.Attribute) and node.func.attr == "new_group")
            or (isinstance(node.func, ast.Name) and node.func.id == "new_group")
        )
    ]


def test_process_groups_only_from_the_distributed_layer() -> None:
    """Groups come from the mesh (slipstream/distributed/mesh.py: the training mesh,
    consecutive_group, member_group); nothing above it creates one."""
    wrong = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("distributed/"):
            continue
        wrong += [f"slipstream/{rel}:{n}" for n in _creates_groups(ast.parse(path.read_text()))]
    assert not wrong, "new_group outside slipstream/distributed (use its mesh helpers):\n" + (
        "\n".join(wrong)
    )
    assert _creates_groups(ast.parse("g = comm.new_group([0, 1], axis='tp')\n")) == [1]


# Modules outside slipstream/accelerator that may name torch.cuda, and why. Everything else asks
# get_accelerator(), so another accelerator needs one change (a new accelerator class).
TORCH_CUDA_ALLOWED = {
    # The CUDA kernels of INT8 matmul and their capability checks.
    "quant/_gemm.py",
    # Data-sheet peak FLOP/s are looked up by the GPU's product name.
    "profiling/flops.py",
    # The planner's calibration measures the GPU it runs on.
    "planner/calibrate.py",
    # The CLI reports the CUDA build and counts GPUs for the launcher.
    "cli/report.py",
    "cli/launcher.py",
    "cli/_demo_worker.py",
}


def _uses_torch_cuda(tree: ast.AST) -> list[int]:
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == "cuda"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    ]


def test_torch_cuda_only_in_the_accelerator() -> None:
    wrong = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("accelerator/") or rel in TORCH_CUDA_ALLOWED:
            continue
        wrong += [f"slipstream/{rel}:{n}" for n in _uses_torch_cuda(ast.parse(path.read_text()))]
    assert not wrong, "torch.cuda outside slipstream/accelerator (use get_accelerator()):\n" + (
        "\n".join(wrong)
    )


def test_the_checker_sees_a_wrong_import(tmp_path: Path) -> None:
    """The rules can fail: an upward import and torch.distributed are both detected."""
    tree = ast.parse("import torch\nx = torch.distributed.get_rank()\n")
    assert _touches_torch_distributed(tree) == [2]
    assert _uses_torch_cuda(ast.parse("import torch\ntorch.cuda.synchronize()\n")) == [2]
    assert FLOOR_OF["runtime"] > FLOOR_OF["zero"] > FLOOR_OF["distributed"]
    zero_shard = PACKAGE / "zero" / "shard.py"
    assert any(_unit(m) == "distributed" for _, m in _imports(zero_shard))
