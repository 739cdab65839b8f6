"""The shape of the repository (docs/DESIGN.md, "The map"), checked from the source text.

* no import cycles between the package's modules (imports inside functions and under ``TYPE_CHECKING``
  count too: a cycle hidden in a function or an annotation is still a cycle);
* the library (everything but ``kforcing_kernels.app``) imports nothing from the app;
* no ``sys.path`` edits in the package, the benchmarks, the tools or the tests;
* no module imports a private name (``_x``) of another module of the package, nor reads one as
  ``module._x``: what another module needs is public and documented (Triton kernels keep their names);
* the custom op's schema is used in one module (ops/window_attention/op.py);
* torch's private APIs are called through ops/common/torch_compat.py only (``torch._C`` never elsewhere; the
  few other private torch names on a documented allow-list);
* one home per name: callers import a name from the module that defines it, not through one that only passes it
  on (package facades' ``__all__`` and the documented re-exports aside), and no other module passes names on;
* the tests sit in the folder of their area (only this file at the top of ``python_tests/``).
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


def _private(name: str) -> bool:
    """A private name: ``_x``, not a dunder."""
    return name.startswith("_") and not name.startswith("__")


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute module ``from ... import`` reads in a file of the dotted ``package`` (relative imports resolve
    against it)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


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
            module = _from_module(node, here)
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

    found, module_names = [], {}  # module_names: local name -> the package module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _from_module(node, here)
            for alias in node.names:
                target = f"{module}.{alias.name}"
                if target in MODULES:  # `from pkg import sub`: a module, bound under its local name
                    module_names[alias.asname or alias.name] = target
                elif module in MODULES and module != name and _private(alias.name):
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
            and _private(node.attr)
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
            if _private(part):
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


# ---------------------------------------------------------------------- one home per name

# Names a module of the package imports from another and keeps importable from itself for its users: each is a
# documented public name of that module. The package facades (``__init__.py``) re-export what their ``__all__``
# lists; besides them, the 0.2 names that moved into a 0.3 module but are defined in a sibling (CHANGELOG.md,
# "Moved in 0.3": an import of the 0.2 name from its new module works; test_moved_modules.py) and the Hugging Face
# integration's public names (README.md). The package's own modules import even these from their homes.
DOCUMENTED_REEXPORTS = {
    f"{APP}.train": {"train"},
    f"{APP}.training.objectives": {
        "forward_distillation_targets",
        "noise_inversion_supervision",
        "self_forcing_targets",
    },
    f"{APP}.training.checkpoint": {
        "CheckpointError",
        "load_tensors",
        "read_json",
        "save_tensors",
        "write_json",
        "write_text",
    },
    f"{APP}.generation.inference": {"Prompts", "Temperature", "pad_prompts"},
    f"{APP}.evaluation.evaluate": {"format_report", "load_judge"},
    # The triton backend hands launch.py out as its kernels() module (launch.py's docstring); the kernel tables and
    # checks its users (tests, the GPU bench, tools/aot_report.py) read from that module.
    f"{PACKAGE}.ops.window_attention.triton.launch": {
        "ALIGNED_STRIDES",
        "CANDIDATE_CONFIGS",
        "FLOAT_ARGS",
        "FP32_POINTERS",
        "GPU_DTYPES",
        "IO_POINTERS",
        "KERNEL_CONFIGS",
        "SUPPORTED_HEAD_DIMS",
        "TILES_BY_HEAD_DIM",
        "TILE_SETS",
        "autotune_enabled",
        "check_head_dim",
        "interpreting",
        "length_bucket",
        "tile_set_for",
        "tiles_for",
    },
    # README.md, "Hugging Face transformers": the K-Forcing inputs and the noise encoder as kf_hf.<name>
    f"{PACKAGE}.integrations.hf": {
        "NoiseEmbedding",
        "additive_mask",
        "kforcing_position_ids",
        "double_forward_position_ids",
        "sbd_position_ids",
        "single_forward_inputs",
        "double_forward_inputs",
        "sbd_inputs",
    },
}


def _top_level_bindings(path: str) -> tuple[set[str], dict[str, tuple[str, int]], list[str]]:
    """(names ``path`` defines, {name it imports from a package module: (that module, line)}, its ``__all__``), at
    module level (inside top-level ``if``/``try`` blocks too; ``if TYPE_CHECKING:`` imports bind nothing at run
    time and are left out)."""
    name = next(n for n, p in MODULES.items() if p == path)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    here = name if _is_package(name) else name.rpartition(".")[0]
    defined: set[str] = set()
    imported: dict[str, tuple[str, int]] = {}
    exported: list[str] = []

    def walk(body):
        for node in body:
            if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                continue
            if isinstance(node, (ast.If, ast.Try)):
                walk(node.body)
                walk(node.orelse)
                for handler in getattr(node, "handlers", ()):
                    walk(handler.body)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name):
                            defined.add(n.id)
                            if n.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                                exported.extend(e.value for e in node.value.elts if isinstance(e, ast.Constant))
            elif isinstance(node, ast.ImportFrom):
                module = _from_module(node, here)
                for alias in node.names:
                    if module in MODULES and f"{module}.{alias.name}" not in MODULES:
                        imported[alias.asname or alias.name] = (module, node.lineno)
                    else:
                        defined.add(alias.asname or alias.name)  # a submodule, or a name of another package
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    defined.add(alias.asname or alias.name.partition(".")[0])

    walk(tree.body)
    return defined, imported, exported


BINDINGS = {name: _top_level_bindings(path) for name, path in MODULES.items()}


def _home(module: str, name: str) -> str:
    """The module that defines ``module.name``, following imports from module to module."""
    seen = set()
    while name in BINDINGS[module][1] and (module, name) not in seen:
        seen.add((module, name))
        module = BINDINGS[module][1][name][0]
    return module


def _imports_through_another_home(path: str, importer: str = "") -> list[str]:
    """``"path:line: module.name (defined in home)"`` for each ``from module import name`` (or ``module.name`` read
    on a module bound by an import) in ``path``, anywhere in the file, where ``module`` does not define ``name`` but
    imports it, and is not a package facade whose ``__all__`` lists it: the caller should import from the defining
    module. ``importer``: the dotted name of ``path`` when it is a module of the package (whose imports must all go
    to the home); a test or benchmark may also use a documented re-export (DOCUMENTED_REEXPORTS)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    here = (importer if _is_package(importer) else importer.rpartition(".")[0]) if importer else ""
    found, module_names = [], {}  # module_names: local name -> the package module it is bound to

    def check(module: str, name: str, line: int):
        _, imported, exported = BINDINGS[module]
        if name not in imported or (_is_package(module) and name in exported):
            return
        if not importer and name in DOCUMENTED_REEXPORTS.get(module, ()):
            return  # a test or a benchmark may use a documented public spelling, as a user would
        found.append(f"{os.path.relpath(path, ROOT)}:{line}: {module}.{name} (defined in {_home(module, name)})")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in MODULES:
                    module_names[alias.asname] = alias.name
        if not isinstance(node, ast.ImportFrom):
            continue
        module = _from_module(node, here)
        for alias in node.names:
            if f"{module}.{alias.name}" in MODULES:
                module_names[alias.asname or alias.name] = f"{module}.{alias.name}"
            elif module in MODULES:
                check(module, alias.name, node.lineno)
    # module.name reads of a module bound above; a name the file patches on that module (``module.name = ...``,
    # ``setattr`` / ``monkeypatch.setattr(module, "name", ...)``) is read there on purpose: patched where it is used.
    patched = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name):
            patched.add((node.value.id, node.attr))
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[0], ast.Name):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called == "setattr" and isinstance(node.args[1], ast.Constant):
                patched.add((node.args[0].id, node.args[1].value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_names:
            if (node.value.id, node.attr) not in patched:
                check(module_names[node.value.id], node.attr, node.lineno)
    return found


# Callers left for the branch of issue 55 that splits app/train.py with the training config (item 4), which
# repoints them: "path: module.name" (line numbers aside). Keep this empty once that lands.
CALLERS_PENDING: set[str] = set()  # callers still to repoint (none)


def test_callers_import_each_name_from_its_home():
    # Issue 55: a name has one home; a module that only passes a name on is not a second one (the package facades,
    # which list what they re-export in __all__, are the documented public homes of the package's API).
    offenders = [hit for name, path in sorted(MODULES.items()) for hit in _imports_through_another_home(path, name)]
    for folder in ("bench", "tools", "python_tests"):
        offenders += [hit for path in _python_files(folder) for hit in _imports_through_another_home(path)]
    pending = {hit for hit in offenders if re.sub(r":\d+: ", ": ", hit).split(" (defined")[0] in CALLERS_PENDING}
    assert [hit for hit in offenders if hit not in pending] == []


def _passed_on(name: str, path: str) -> list[str]:
    """``"module.name (defined in home)"`` for each name the module ``name`` (not a package facade) imports at module
    level and re-exports (``from .x import name as name``, or lists in ``__all__``) that is not on
    DOCUMENTED_REEXPORTS."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    _, imported, exported = BINDINGS[name]
    marked = {
        alias.asname
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname is not None and alias.asname == alias.name
    }
    return [
        f"{name}.{passed} (defined in {_home(name, passed)})"
        for passed in sorted((marked | set(exported)) & set(imported))
        if passed not in DOCUMENTED_REEXPORTS.get(name, set())
    ]


def test_modules_pass_on_only_documented_names():
    # A module that is not a package facade re-exports only documented public names of it (DOCUMENTED_REEXPORTS).
    offenders = [
        hit for name, path in sorted(MODULES.items()) if not _is_package(name) for hit in _passed_on(name, path)
    ]
    assert offenders == []


def test_the_pass_on_finder_sees_both_forms(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from .targets import chunk_bounds as chunk_bounds\nfrom .targets import teacher_head, output_head\n"
        "from .targets import decode_chunks\n__all__ = ['teacher_head', 'local']\nlocal = decode_chunks\n"
    )
    name = f"{APP}.training.planted"
    MODULES[name] = str(planted)
    try:
        BINDINGS[name] = _top_level_bindings(str(planted))
        hits = _passed_on(name, str(planted))
    finally:
        del MODULES[name]
        BINDINGS.pop(name, None)
    targets = f"{APP}.training.targets"
    assert hits == [f"{name}.chunk_bounds (defined in {targets})", f"{name}.teacher_head (defined in {targets})"]


def test_documented_reexports_are_reexports():
    for name, passed in DOCUMENTED_REEXPORTS.items():
        assert passed <= set(BINDINGS[name][1]), (name, passed - set(BINDINGS[name][1]))


def test_the_home_finder_sees_a_planted_pass_through(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "from kforcing_kernels.model.gpt import KForcingLM\nfrom kforcing_kernels.model import ModelConfig\n"
        "from kforcing_kernels.app.training.objectives import compute_loss\n"
    )
    objectives = f"{APP}.training.objectives"
    before = BINDINGS[objectives]
    BINDINGS[objectives] = (
        before[0] - {"compute_loss"},
        {**before[1], "compute_loss": (f"{APP}.training.targets", 1)},
        [],
    )
    try:
        hits = _imports_through_another_home(str(planted))
    finally:
        BINDINGS[objectives] = before
    # KForcingLM is gpt's own; ModelConfig comes through the model package's facade (__all__); compute_loss was
    # planted as passed on by objectives (from targets).
    assert [h.split(": ", 1)[1] for h in hits] == [f"{objectives}.compute_loss (defined in {APP}.training.targets)"]


def test_tests_sit_in_the_folder_of_their_area():
    # python_tests/README.md: the folders mirror the package (and packaging/, docs/ for what no module holds); only
    # this file, the repository's shape, stays at the top beside conftest.py.
    top = sorted(
        f for f in os.listdir(os.path.join(ROOT, "python_tests")) if f.startswith("test_") and f.endswith(".py")
    )
    assert top == [os.path.basename(__file__)]


# ---------------------------------------------------------------------- tests and bench use public hooks

# Tests and benchmarks observe the package through public names (the caches' ``*_info()`` / ``clear_*`` hooks,
# behaviour); a private name of a package (or bench) module that a test or bench module reads, imports or patches
# is one of these, each with why no public hook or behaviour serves. Private modules (``_extension``, ``_C``,
# ``bench._cli``) and Triton kernels' ``_``-names (profiler names, see above) are not counted.
_OUTSIDE_READS_ALLOWED = {
    # planted failures and forced code paths: no input selects them on this machine
    f"{PACKAGE}.app.train._evaluate": "replaced to plant a failing evaluation after training (resume checks)",
    "bench.training.stage1_curve._train": "replaced by a stub that writes a stage's files (no real training)",
    f"{PACKAGE}.ops.window_attention.lse_attention._use_flash_cpu": "forces the non-flash CPU route",
    f"{PACKAGE}.ops.window_attention.composite.pieces._loop_per_head": "forces the per-head loop",
    f"{PACKAGE}.ops.window_attention.lse_attention._MATH_ROW_CHUNK": "shrunk so tiny shapes span several chunks",
    f"{PACKAGE}.ops.window_attention.lse_attention._TILE_ROWS": "shrunk so tiny shapes span several tiles",
    f"{PACKAGE}.ops.window_attention.triton.configs._capability": "plants a GPU capability on CPU",
    f"{PACKAGE}.ops.window_attention.triton.configs._capabilities": "plants the GPUs' capabilities on CPU",
    f"{PACKAGE}.ops.window_attention.triton.plan_device._capturing": "plants a CUDA-graph capture on CPU",
    f"{PACKAGE}.ops.window_attention.op._plain_eager": "which entry a call under a mode takes: no mode-free probe",
    # the Triton launcher's internals, compiled against a stub driver on CPU (tests) or timed (bench/gpu)
    f"{PACKAGE}.ops.window_attention.triton.launch._launch": "recorded / timed per launch (host cost, dispatch)",
    f"{PACKAGE}.ops.window_attention.triton.launch._direct": "the direct-launch cache, emptied under the stub",
    f"{PACKAGE}.ops.window_attention.triton.launch._tuned": "the autotuners, emptied when tile tables change",
    f"{PACKAGE}.ops.window_attention.triton.launch._tuned_kernel": "the autotuner a key builds, checked per key",
    f"{PACKAGE}.ops.window_attention.triton.launch._tune_key": "the autotune key, checked per shape",
    f"{PACKAGE}.ops.window_attention.triton.launch._resolve_tiles": "the tile choice, checked per switch",
    f"{PACKAGE}.ops.window_attention.triton.launch._check_shapes": "the launcher's own shape checks (no GPU)",
    f"{PACKAGE}.tools.aot_report._constexprs": "the AOT report's constexpr table, checked against the kernels",
    f"{PACKAGE}.tools.aot_report._signature": "the AOT report's signature, checked against the kernels",
    # pure helpers tested on their own (unit tests of a step the public function hides)
    f"{PACKAGE}.ops.window_attention.composite._element_layout": "composite's element layout, against the mask",
    f"{PACKAGE}.ops.window_attention.composite.pieces._prefix_chunks": "the chunking rule, on edge lengths",
    f"{PACKAGE}.parallel.context_parallel._all_gather_single": "the collective's single-process path",
    f"{PACKAGE}.parallel.context_parallel._reduce_scatter_single": "the collective's single-process path",
    f"{PACKAGE}.app.data._train_tokenizer": "a small tokenizer trained in the test (the CLI trains one per run)",
    f"{PACKAGE}.app.training.stage._optimizer": "the optimizer a stage builds, checked per option",
    f"{PACKAGE}.app.evaluation.evaluate._hf_generate": "the HF generation call, checked on a tiny model",
    f"{PACKAGE}.app.hf_recipe.export._hf_tokenizer": "the exported tokenizer, checked on its own",
}
_OUTSIDE_PACKAGES = (PACKAGE, "bench")


def _outside_module_file(dotted: str) -> str | None:
    """The file of module ``dotted`` of the package or of bench/, or None (a name that is not a module)."""
    base = os.path.join(ROOT, *dotted.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    return None


def _outside_private_reads(path: str) -> list[str]:
    """``"module._name"`` for each private name (``_x``, not ``__x__``) of a package or bench module that the file
    at ``path`` imports (``from m import _x``), reads (``m._x``, ``m.sub._x``) or patches (``setattr(m, "_x")``,
    ``setattr("m._x")``), ``m`` bound by an import; a Triton kernel of the module is exempt."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    here = ".".join(os.path.relpath(os.path.dirname(path), ROOT).split(os.sep))

    found, module_names = set(), {name: name for name in _OUTSIDE_PACKAGES}

    def hit(module: str, attr: str) -> None:
        file = _outside_module_file(module)
        if file and _private(attr) and not _outside_module_file(f"{module}.{attr}"):
            if attr not in _private_definitions_exempt(file):
                found.add(f"{module}.{attr}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _from_module(node, here)
            if module.split(".")[0] not in _OUTSIDE_PACKAGES:
                continue
            for alias in node.names:
                if _outside_module_file(f"{module}.{alias.name}"):
                    module_names[alias.asname or alias.name] = f"{module}.{alias.name}"
                else:
                    hit(module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name.split(".")[0] in _OUTSIDE_PACKAGES:
                    module_names[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, value = [], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in module_names:
                hit(".".join([module_names[value.id], *reversed(chain)]), node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr":
            args = node.args
            if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
                module, _, attr = args[0].value.rpartition(".")
                if module.split(".")[0] in _OUTSIDE_PACKAGES:
                    hit(module, attr)
            elif len(args) > 1 and isinstance(args[0], ast.Name) and args[0].id in module_names:
                if isinstance(args[1], ast.Constant) and isinstance(args[1].value, str):
                    hit(module_names[args[0].id], args[1].value)
    return sorted(found)


def _outside_files() -> list[str]:
    return sorted(
        os.path.join(folder, name)
        for top in ("python_tests", "bench")
        for folder, _, names in os.walk(os.path.join(ROOT, top))
        if "results" not in os.path.relpath(folder, ROOT).split(os.sep)
        for name in names
        if name.endswith(".py")
    )


def test_tests_and_bench_read_no_private_state_of_the_package():
    seen: dict[str, list[str]] = {}
    for path in _outside_files():
        for target in _outside_private_reads(path):
            seen.setdefault(target, []).append(os.path.relpath(path, ROOT))
    unlisted = {target: files for target, files in seen.items() if target not in _OUTSIDE_READS_ALLOWED}
    assert unlisted == {}, "a public hook (or the behaviour) instead, or an _OUTSIDE_READS_ALLOWED entry with a reason"
    stale = sorted(set(_OUTSIDE_READS_ALLOWED) - set(seen))
    assert stale == [], "allow-list entries nothing reads any more"


def test_the_outside_private_read_finder_sees_every_form(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text(
        "from kforcing_kernels.ops.window_attention import op\n"
        "import kforcing_kernels.ops.window_attention.triton.plan_device as pd\n"
        "from kforcing_kernels.app.data import _train_tokenizer\n"
        "from kforcing_kernels import _extension\n"  # a private module: not counted
        "import kforcing_kernels\n"
        "op._eager_cache.clear()\n"
        "kforcing_kernels.layouts.derived._interned\n"
        "monkeypatch.setattr(pd, '_capturing', None)\n"
        "monkeypatch.setattr('kforcing_kernels.app.train._evaluate', None)\n"
        "from kforcing_kernels.ops.sampling.triton_kernels import _block_stats\n"  # a Triton kernel: exempt
        "op.eager_cache_info().size\n"
    )
    assert _outside_private_reads(str(planted)) == [
        f"{PACKAGE}.app.data._train_tokenizer",
        f"{PACKAGE}.app.train._evaluate",
        f"{PACKAGE}.layouts.derived._interned",
        f"{PACKAGE}.ops.window_attention.op._eager_cache",
        f"{PACKAGE}.ops.window_attention.triton.plan_device._capturing",
    ]
