"""The shape of the repository (docs/DESIGN.md, "The map"), checked from the source text.

* no import cycles between the package's modules (imports inside functions and under ``TYPE_CHECKING``
  count too: a cycle hidden in a function or an annotation is still a cycle);
* the library (everything but ``kforcing_kernels.app``) imports nothing from the app;
* no ``sys.path`` edits in the package, the benchmarks, the tools or the tests;
* no module imports a private name (``_x``) of another module of the package, nor reads one as
  ``module._x``: what another module needs is public and documented (Triton kernels keep their names).
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
    here = os.path.relpath(os.path.dirname(path), ROOT).split(os.sep)

    def private(attr: str) -> bool:
        return attr.startswith("_") and not attr.startswith("__")

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = here[: len(here) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    found, module_names = set(), {name: name for name in _OUTSIDE_PACKAGES}

    def hit(module: str, attr: str) -> None:
        file = _outside_module_file(module)
        if file and private(attr) and not _outside_module_file(f"{module}.{attr}"):
            if attr not in _private_definitions_exempt(file):
                found.add(f"{module}.{attr}")

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = resolve(node)
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
        if isinstance(node, ast.Attribute) and private(node.attr):
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
