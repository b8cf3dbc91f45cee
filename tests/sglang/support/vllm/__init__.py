"""A stand-in for the ``vllm`` package, for SGLang's test server only (not vLLM, not for users).

SGLang 0.5.23 without a GPU imports ``vllm._custom_ops.rotary_embedding`` when it builds its
rotary embedding (``sglang/srt/layers/rotary_embedding/base.py``): a CUDA kernel it borrows from
vLLM. Its own venv has no vLLM (vLLM pins another torch), and a CPU build of ``sgl-kernel`` does
not exist for this machine, so ``tests/sglang/shared_server.py`` puts this folder on the server's
``PYTHONPATH``: ``vllm._custom_ops`` here provides that one function in pure torch. Nothing else
of vLLM is here: MoE models (which import more of ``_custom_ops``) would not load.
"""
