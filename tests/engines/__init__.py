"""Real serving engines in the test bed: their installs live in venvs of their own (scripts/install-vllm.sh)."""
