"""One instrumentation per serving framework.

Each module holds a ``BaseInstrumentor`` subclass whose patches are declared once in a table and
reversed by ``uninstrument()``. Importing a module here never imports its framework: patches are
applied when (and if) the framework's own modules are imported.
"""
