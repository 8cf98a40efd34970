"""Shared fixtures and CPU-tier settings (keep small)."""
from __future__ import annotations

import os

import pytest
import torch

# The CPU tier runs under xdist with one worker per core: one torch thread per worker avoids oversubscription
# (small batched forwards ran several times slower with 2 threads per worker on the 2-core CI machine).
if not torch.cuda.is_available():
    torch.set_num_threads(1)

# DESIGN §7: property tests run under a fixed profile (derandomised, bounded) unless HYPOTHESIS_PROFILE says
# otherwise (e.g. HYPOTHESIS_PROFILE=explore for a long randomised search); tests may still bound themselves further.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=50,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", derandomize=False, deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser, pluginmanager):
    """The harness plugin (--hq-model, --hq-trace, hq_case) normally comes from the install's `pytest11` entry
    point; a checkout used through PYTHONPATH without `pip install` (the GPU machine) registers it from source."""
    if not pluginmanager.has_plugin("hybridqual"):
        from hybridqual import pytest_hq
        pluginmanager.register(pytest_hq, "hybridqual")


def pytest_report_header(config):
    """Record the external oracle's version (DESIGN §2/§11: HF's own semantics move between versions)."""
    try:
        import transformers
        return f"transformers (external oracle) {transformers.__version__}"
    except ImportError:
        return "transformers not installed: HF cross-check tests will be skipped"


@pytest.fixture(scope="session")
def zoo_folder(tmp_path_factory):
    """zoo_folder(variant, seed=0) -> path of an HF folder written by oracle.zoo (cached for the test run)."""
    from oracle.zoo import VARIANTS, write_hf_folder
    cache: dict[tuple[str, int], str] = {}

    def make(variant: str, seed: int = 0) -> str:
        if (variant, seed) not in cache:
            arch, overrides = VARIANTS[variant]
            path = os.fspath(tmp_path_factory.mktemp(f"zoo-{variant}-{seed}"))
            write_hf_folder(path, arch, seed=seed, **overrides)
            cache[(variant, seed)] = path
        return cache[(variant, seed)]
    return make
