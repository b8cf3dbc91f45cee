"""The drill-down API and web UI, served from the request store (``docs/ui.md``)."""

from tokentrace.collector.api.app import ApiSettings, create_app

__all__ = ["ApiSettings", "create_app"]
