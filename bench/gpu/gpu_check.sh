#!/usr/bin/env bash
# Kept for old commands: the GPU check is bench/gpu/check.py (`python -m bench gpu-check --list` shows the plan).
cd "$(dirname "${BASH_SOURCE[0]}")/../.." && exec "${PYTHON:-python3}" -m bench gpu-check "$@"
