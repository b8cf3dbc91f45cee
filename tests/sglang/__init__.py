"""SGLang's own tracing (``--enable-trace``) read by the collector as the ``sglang`` dialect.

``test_sglang_dialect.py`` runs on a committed capture of real SGLang spans (fast, no SGLang
needed); ``test_sglang_server.py`` runs the real server from its own venv (``make sglang-venv``)
through the session fixture in ``shared_server.py`` (slow).
"""
