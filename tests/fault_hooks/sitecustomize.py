"""Installs the tests' fault injection (`faults.install`) in every Python process the tests start: conftest.py puts
this directory on ``PYTHONPATH``. Inert unless ``RLHF_TRL_FAULT`` / ``RLHF_TRL_FAULT_LOG`` is set."""

import os

if os.environ.get("RLHF_TRL_FAULT") or os.environ.get("RLHF_TRL_FAULT_LOG"):
    import faults

    faults.install()
