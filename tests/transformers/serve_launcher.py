"""``transformers serve`` for the tests, run as ``tokentrace run -- python serve_launcher.py
serve ...`` (``tokentrace run`` instruments it through the ``transformers`` entry point).

``transformers serve`` loads its model with ``device_map`` set to its ``--device``, which
transformers accepts only with ``accelerate`` installed; the project's environment has no
``accelerate``. With ``--device cpu`` a model loads on the CPU without a device map, so the
launcher drops a ``"cpu"`` map where ``accelerate`` is missing (the same model, the same place;
``transformers[serving]``, what users install, brings ``accelerate``).
"""

from __future__ import annotations

import sys


def _cpu_without_accelerate() -> None:
    from transformers import modeling_utils
    from transformers.utils import is_accelerate_available

    if is_accelerate_available():
        return
    check = modeling_utils.check_and_set_device_map

    def cpu_needs_no_map(device_map: object) -> object:
        return None if device_map == "cpu" else check(device_map)

    modeling_utils.check_and_set_device_map = cpu_needs_no_map


if __name__ == "__main__":
    _cpu_without_accelerate()
    from transformers.cli.transformers import main

    sys.argv[0] = "transformers"
    sys.exit(main())
