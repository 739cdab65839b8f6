"""The shape of the repository (docs/DESIGN.md, "The map"), checked from the source text.

* no import cycles between the package's modules (imports inside functions and under ``TYPE_CHECKING``
  count too: a cycle hidden in a function or an annotation is still a cycle);
* the library (everything but ``kforcing_kernels.app``) imports nothing from the app;
* no ``sys.path`` edits in the package, the benchmarks, the tools or the tests;
* no module imports a private name (``_x``) of another module of the package, nor reads one as
  ``module._x``: what another module needs is public and documented (Triton kernels keep their names);
* the custom op's schema is used in one module (ops/window_attention/op.py);
* torch's private APIs are called through ops/common/torch_compat.py only (``torch._C`` never elsewhere; the
  few other private torch names on a documented allow-list).
"""

from __future__ import annotations

import ast
import os
import re

from helpers import REPO

ROOT = str(REPO)
PACKAGE = "kforcing_kernels"


def _modules(top: str, package_name: str) -> dict[str, str]:
    """{dotted module name: path} of every .py file under ``top`` (a package folder)."""
    out = {}
    for folder, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), top)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join([package_name, *rel])] = os.path.join(folder, f)
    return out


MODULES = _modules(os.path.join(ROOT, PACKAGE), PACKAGE)


def _is_package(name: str) -> bool:
    return MODULES.get(name, "").endswith("__init__.py")


def _imports(name: str, path: str, typing_only: bool = True) -> set[str]:
    """The package modules ``name`` imports (module level, inside functions and, with ``typing_only``, under
    ``TYPE_CHECKING``)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    here = name if _is_package(name) else name.rpartition(".")[0]
    # `if TYPE_CHECKING:` imports count for the cycles: an annotation that needs the module's importer is a
    # circle in the design (the type checker follows it), even though it never runs.
    skipped = set()
    if not typing_only:
        skipped = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
            for stmt in block.body
            for n in ast.walk(stmt)
        }
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub when there is one.
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}
RUNTIME_GRAPH = {name: _imports(name, path, typing_only=False) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), plus self-loops."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            # A module importing one of its ancestor packages is Python's normal package initialisation.
            if v.startswith(w + "."):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_was_read():
    assert len(MODULES) > 40
    assert "kforcing_kernels.app.training.loop" in GRAPH["kforcing_kernels.app.training.pipeline"]
    assert "kforcing_kernels.ops.window_attention" in GRAPH["kforcing_kernels.model.gpt"]


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_cycles_count_type_checking_imports(tmp_path):
    # An import under `if TYPE_CHECKING:` is an edge: a planted annotation-only import back closes a circle.
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .window_layout import WindowLayout\n"
    )
    name = f"{PACKAGE}.layouts.planted"
    MODULES[name] = str(planted)
    try:
        graph = {k: set(v) for k, v in GRAPH.items()}
        graph[name] = _imports(name, str(planted))
        graph[f"{PACKAGE}.layouts.window_layout"].add(name)
        assert _imports(name, str(planted), typing_only=False) == set()
    finally:
        del MODULES[name]
    assert any(name in c and f"{PACKAGE}.layouts.window_layout" in c for c in _cycles(graph))


def test_cycle_finder_finds_a_planted_cycle():
    graph = {k: set(v) for k, v in GRAPH.items()}
    # the cycle of 0.2 (train <-> pipeline)
    graph["kforcing_kernels.app.training.loop"].add("kforcing_kernels.app.train")
    assert any("kforcing_kernels.app.train" in c and "kforcing_kernels.app.training.loop" in c for c in _cycles(graph))


def test_the_library_imports_nothing_from_the_app():
    app = f"{PACKAGE}.app"
    offenders = {
        name: sorted(t for t in targets if t == app or t.startswith(app + "."))
        for name, targets in GRAPH.items()
        if not (name == app or name.startswith(app + "."))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def _python_files(*folders: str):
    for folder in folders:
        for base, dirs, files in os.walk(os.path.join(ROOT, folder)):
            dirs[:] = [d for d in dirs if d not in ("__pycache__", "results")]
            for f in files:
                if f.endswith(".py"):
                    yield os.path.join(base, f)


def test_no_sys_path_edits():
    pattern = re.compile(r"sys\.path\.(insert|append|extend)|sys\.path\s*(\+?=)")
    offenders = []
    for path in _python_files(PACKAGE, "bench", "tools", "python_tests"):
        with open(path) as f:
            for i, line in enumerate(f, 1):
                if pattern.search(line) and path != os.path.abspath(__file__):
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{i}")
    assert offenders == []


def _window_op_schema_users(*folders: str) -> set[str]:
    """Modules that call the window_attention custom op or build its arguments (``layout_args``)."""
    pattern = re.compile(
        r"torch\.ops\.kforcing_kernels\.window_attention|kforcing_kernels::window_attention|\blayout_args\("
    )
    users = set()
    for path in _python_files(*folders):
        with open(path) as f:
            if pattern.search(f.read()):
                users.add(os.path.relpath(path, ROOT))
    return users


def test_the_window_op_schema_is_used_in_one_module():
    # Issue 55: the op's positional arguments are known to the op's own module only; other code (the HF
    # integration's traced sliding-window path) calls a public function of it (window_attention_with_bounds).
    assert _window_op_schema_users(PACKAGE) == {f"{PACKAGE}/ops/window_attention/op.py"}


def test_the_schema_finder_sees_a_planted_call(tmp_path):
    (tmp_path / "planted.py").write_text("out, lse = torch.ops.kforcing_kernels.window_attention(q, k, v, *a)\n")
    (tmp_path / "clean.py").write_text("out = window_attention_with_bounds(q, k, v, layout)\n")
    users = _window_op_schema_users(str(tmp_path))  # an absolute folder: os.path.join keeps it
    assert [os.path.basename(u) for u in users] == ["planted.py"]


# ---------------------------------------------------------------------- the seam between model kinds (app/student.py)

APP = f"{PACKAGE}.app"


def _imports_between(source: str, target: str) -> dict[str, list[str]]:
    """{module under ``source``: the modules under ``target`` it imports} (module level and inside functions)."""

    def under(name, top):
        return name == top or name.startswith(top + ".")

    return {
        name: sorted(t for t in targets if under(t, target))
        for name, targets in GRAPH.items()
        if under(name, source) and any(under(t, target) for t in targets)
    }


def test_training_never_imports_the_hugging_face_recipe():
    # The trainer reaches every kind of model through the registry of app/student.py, never a kind's own modules.
    assert _imports_between(f"{APP}.training", f"{APP}.hf_recipe") == {}


def test_the_hugging_face_recipe_imports_only_the_objectives_from_training():
    # One direction only: the HF Trainer route (hf_recipe/trainer.py) computes the CLI's loss with the objectives; the
    # recipe's files, model and kind need nothing of the trainer (file I/O is app/files.py's).
    found = _imports_between(f"{APP}.hf_recipe", f"{APP}.training")
    assert {t for targets in found.values() for t in targets} <= {f"{APP}.training.objectives"}, found


def test_generation_and_evaluation_reach_models_through_the_registry():
    for area in ("generation", "evaluation"):
        assert _imports_between(f"{APP}.{area}", f"{APP}.hf_recipe") == {}, area
        assert _imports_between(f"{APP}.{area}", f"{APP}.native") == {}, area


def test_the_registry_imports_no_kind():
    # Kinds are named by "module:attribute" and loaded on first use (as ops/common/registry.py loads backends);
    # an annotation may name the app's types (TYPE_CHECKING), which loads nothing.
    assert {t for t in RUNTIME_GRAPH[f"{APP}.student"] if t.startswith(APP + ".")} == set()


def test_nothing_outside_the_hugging_face_recipe_asks_whether_a_model_is_one():
    pattern = re.compile(r"\bis_hf\w*\b")
    offenders = []
    for path in _python_files(PACKAGE):
        if os.sep + os.path.join("app", "hf_recipe") + os.sep in path:
            continue
        with open(path) as f:
            offenders += [f"{os.path.relpath(path, ROOT)}:{i}" for i, line in enumerate(f, 1) if pattern.search(line)]
    assert offenders == []


def test_the_seam_finder_sees_a_planted_import():
    graph_before = GRAPH[f"{APP}.training.stage"]
    GRAPH[f"{APP}.training.stage"] = graph_before | {f"{APP}.hf_recipe.files"}
    try:
        found = _imports_between(f"{APP}.training", f"{APP}.hf_recipe")
        assert found == {f"{APP}.training.stage": [f"{APP}.hf_recipe.files"]}
    finally:
        GRAPH[f"{APP}.training.stage"] = graph_before


# ---------------------------------------------------------------------- private names stay in their module

# A Triton kernel's (or device helper's) Python name is its name in profiler traces, the AOT report and the GPU
# check's records, and the ``_``-prefix is the convention of the kernel libraries (fla, flash-attn): a
# ``@triton.jit`` function (or one made by a decorator of that kind, ``jit_common.jit_kernel``) may keep it
# while the kernel modules of its backend import it.
_KERNEL_DECORATORS = re.compile(r"\b(triton\.jit|triton\.autotune|jit_kernel)\b")


def _private_definitions_exempt(path: str) -> set[str]:
    """The names of ``path``'s Triton kernels (functions decorated by a Triton jit or a wrapper of it)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any(_KERNEL_DECORATORS.search(ast.unparse(d)) for d in node.decorator_list)
    }


def _private_imports(name: str, path: str) -> list[str]:
    """``"name:line: module.attribute"`` for each private name (``_x``, not ``__x__``) that ``name`` imports from
    another module of the package, or reads as an attribute of a package module it imported (``mod._x``).
    Private *modules* (``_extension``, ``_C``, ``_moved``) are the package's own business: importing them is fine."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    here = name if _is_package(name) else name.rpartition(".")[0]

    def private(attr: str) -> bool:
        return attr.startswith("_") and not attr.startswith("__")

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = here.split(".")
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    found, module_names = [], {}  # module_names: local name -> the package module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = resolve(node)
            for alias in node.names:
                target = f"{module}.{alias.name}"
                if target in MODULES:  # `from pkg import sub`: a module, bound under its local name
                    module_names[alias.asname or alias.name] = target
                elif module in MODULES and module != name and private(alias.name):
                    if alias.name not in _private_definitions_exempt(MODULES[module]):
                        found.append(f"{name}:{node.lineno}: {module}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in MODULES:
                    module_names[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in module_names
            and private(node.attr)
            and MODULES.get(f"{module_names[node.value.id]}.{node.attr}") is None
        ):
            module = module_names[node.value.id]
            if module != name and node.attr not in _private_definitions_exempt(MODULES[module]):
                found.append(f"{name}:{node.lineno}: {module}.{node.attr}")
    return found


def test_no_module_imports_a_private_name_of_another():
    # What another module needs is public and documented; what only one module needs stays private in it.
    offenders = [hit for name, path in sorted(MODULES.items()) for hit in _private_imports(name, path)]
    assert offenders == []


def test_the_private_name_finder_sees_both_forms(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from .plan import _hidden, tile_plan\nfrom . import plan\nfrom .jit_common import "
        "_row_interval\n"
        "plan._other()\n"
    )
    name = f"{PACKAGE}.ops.window_attention.triton.planted"
    MODULES[name] = str(planted)
    try:
        hits = _private_imports(name, str(planted))
    finally:
        del MODULES[name]
    plan = f"{PACKAGE}.ops.window_attention.triton.plan"
    assert hits == [f"{name}:1: {plan}._hidden", f"{name}:4: {plan}._other"]  # a Triton jit helper is exempt


# -------------------------------------------------------------------- torch's private APIs (ops/common/torch_compat.py)

TORCH_COMPAT = f"{PACKAGE}/ops/common/torch_compat.py"

# The private torch names used outside torch_compat.py, each with why it stays there: a base class, a type to test
# against, a config to set, a marker dynamo reads (no conservative answer torch_compat could fall back to), or an
# ATen op already looked up with a fallback where it is called. ``torch._C`` is never allowed outside torch_compat.py.
TORCH_PRIVATE_ALLOWED = {
    (f"{PACKAGE}/ops/window_attention/flex.py", "torch._dynamo"): "config: the recompile limits flex_attention "
    "needs have no public setter; each is patched only where it exists (hasattr)",
    (f"{PACKAGE}/app/generation/static_step.py", "torch._dynamo"): "mark_static_address: the CUDA-graph pools' "
    "static addresses, as torch.compile's docs spell it; once per generator",
    (f"{PACKAGE}/app/student.py", "torch._dynamo"): "eval_frame.OptimizedModule, torch.compile's wrapper type, "
    "to unwrap a compiled student",
    (
        f"{PACKAGE}/ops/window_attention/lse_attention.py",
        "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu",
    ): (
        "the LSE-returning CPU flash kernel (no public op returns the LSE); looked up with hasattr, so a torch "
        "without it takes the math path (_use_flash_cpu)"
    ),
    (f"{PACKAGE}/tools/memory.py", "torch.utils._python_dispatch"): "TorchDispatchMode, the base class of a "
    "dispatch mode (a measuring tool, not the op path)",
    (f"{PACKAGE}/tools/memory.py", "torch.utils._pytree"): "tree_leaves over an operator's arguments (the same tool)",
}


def _private_torch_uses(path: str) -> dict[str, int]:
    """{torch name up to its first private part (``torch._C``, ``torch.utils._pytree``): first line} for each
    private torch module or attribute ``path`` imports or reads (``import``, ``from ... import``, ``torch._x.y``)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)

    def up_to_private(dotted: str):
        parts = dotted.split(".")
        if parts[0] != "torch":
            return None
        for i, part in enumerate(parts[1:], 1):
            if part.startswith("_") and not part.startswith("__"):
                return ".".join(parts[: i + 1])
        return None

    found: dict[str, int] = {}

    def note(dotted: str, line: int):
        name = up_to_private(dotted)
        if name is not None:
            found.setdefault(name, line)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                note(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                note(f"{node.module}.{alias.name}", node.lineno)
        elif isinstance(node, ast.Attribute):
            chain, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name):
                note(".".join([inner.id, *reversed(chain)]), node.lineno)
    return found


def _private_torch_offenders(folder: str) -> list[str]:
    offenders = []
    for path in _python_files(folder):
        rel = os.path.relpath(path, ROOT)
        if rel == TORCH_COMPAT:
            continue
        for name, line in sorted(_private_torch_uses(path).items()):
            if name == "torch._C" or (rel, name) not in TORCH_PRIVATE_ALLOWED:
                offenders.append(f"{rel}:{line}: {name}")
    return offenders


def test_private_torch_apis_are_called_through_torch_compat_only():
    # Issue 55: a private torch API carries no promise across the supported torch releases; torch_compat.py looks
    # each up once and falls back conservatively where one is missing (tested per API).
    assert _private_torch_offenders(PACKAGE) == []


def test_the_private_torch_allow_list_has_no_stale_entry():
    used = {(os.path.relpath(p, ROOT), name) for p in _python_files(PACKAGE) for name in _private_torch_uses(p)}
    assert set(TORCH_PRIVATE_ALLOWED) <= used


def test_the_private_torch_finder_sees_every_form(tmp_path):
    (tmp_path / "planted.py").write_text(
        "import torch\nimport torch._dynamo\nfrom torch.utils._pytree import tree_map\n"
        "from torch.utils import _pytree\nx = torch._C._functorch.peek_interpreter_stack()\n"
        "y = torch.nn.functional.relu\nz = torch.__version__\n"
    )
    assert _private_torch_uses(str(tmp_path / "planted.py")) == {
        "torch._dynamo": 2,
        "torch.utils._pytree": 3,
        "torch._C": 5,
    }
