"""Every test runs offline: Hugging Face's libraries are told so before any test imports them, so a hub id fails
at once with their offline error instead of trying the network (which the swarm tests' namespace lacks)."""

import os

for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(name, "1")
