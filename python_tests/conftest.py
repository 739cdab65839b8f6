import os

import pytest
import torch

# Tests are CPU-only and deterministic; keep thread count small like CI's 2 cores.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# KFORCING_REQUIRE_EXT=1 (set by .ci/run): the C++ extension is expected. Without it the
# cpp tests skip and the backend lists silently drop "cpp", so a failed build would leave
# CI green; with it, a missing extension ends the session with an error and any skip that
# names the extension becomes a failure. An explicit KFORCING_DISABLE_EXT=1 (the fallback
# subprocess runs) means the extension is not expected.
REQUIRE_ENV = "KFORCING_REQUIRE_EXT"
_EXT_SKIP_MARKERS = ("cpp backend", "C++ extension", "kforcing_kernels._C")


def _flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def extension_required() -> bool:
    return _flag(REQUIRE_ENV) and not _flag("KFORCING_DISABLE_EXT")


def extension_problem():
    """None when the cpp backend is usable, else why not."""
    from kforcing_kernels import backends_available

    return backends_available()["cpp"]


def pytest_sessionstart(session):
    if extension_required() and extension_problem() is not None:
        pytest.exit(f"{REQUIRE_ENV}=1 but the C++ extension is not usable: {extension_problem()}", returncode=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and extension_required():
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if any(m in reason for m in _EXT_SKIP_MARKERS):
            report.outcome = "failed"
            report.longrepr = f"{REQUIRE_ENV}=1 turns this skip into a failure: {reason}"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "fuzz_long: the long random-layout fuzzer (run with -m fuzz_long; counts from KFORCING_FUZZ_COUNT)"
    )


def pytest_collection_modifyitems(config, items):
    # The long fuzzer runs only when selected explicitly with -m fuzz_long.
    if "fuzz_long" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="long fuzzer: run with -m fuzz_long")
    for item in items:
        if "fuzz_long" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def isolated_cache(tmp_path_factory):
    """KFORCING_CACHE in a fresh folder for the module (tokenizer and dataset caches never shared)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KFORCING_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield
