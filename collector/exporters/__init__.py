"""Exporters that send the collector's output onward.

:mod:`.otlp` holds the upstream OTLP trace and metric exporters (``OtlpExporterConfig``,
``OtlpTraceExporter``, ``OtlpMetricExporter``). This package module imports nothing itself so that
commands which only read the store never load gRPC.
"""
