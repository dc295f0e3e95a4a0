"""Every test runs offline: Hugging Face's libraries are told so before any test imports them, so a hub id fails
at once with their offline error instead of trying the network (which the swarm tests' namespace lacks)."""

import os

for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(name, "1")

# property tests (tests/unit/test_properties.py): the same examples on every run, so CI is reproducible and a
# failure shows again where it was seen; no example database written into the checkout; no per-example deadline
# (a loaded 2-core machine is slow, not wrong)
try:
    from hypothesis import settings

    settings.register_profile("p2pdiloco", derandomize=True, database=None, deadline=None, max_examples=60,
                              print_blob=True)
    settings.load_profile("p2pdiloco")
except ImportError:  # scripts that import tests without the test extras
    pass
