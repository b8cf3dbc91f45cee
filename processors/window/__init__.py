"""Window analytics: a window of requests (a time range or a load run) analysed, pure and I/O-free.

One home for what ``tokentrace diagnose`` and ``compare``, their API routes and the fleet view
compute over a window; the modules are imported directly (nothing is re-exported here):

- ``analysis``: ``analyze_window``, the whole analysis of a window's request records: per-metric
  and per-segment percentiles, the findings, the perceived speed and the SLO status;
- ``findings``: what dominates a window, one finding per SLO target (``target_findings``) and per
  metric (``metric_findings``), with the counterfactual; ``finding_lines`` words one;
- ``perceived_speed``: what users felt beyond the latency metrics (streaming, first byte,
  connections), from the window's client spans;
- ``compare``: two window reports side by side (percentiles per key and metric, and SLOs).

Reading a window from the store (``collector/window.py``: the records of stored traces) and the
CLI's diagnose/compare over a store (``collector/diagnose.py``) stay on the collector side.
"""
